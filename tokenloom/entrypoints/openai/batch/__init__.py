"""Batches: OpenAI's Files and Batch APIs in the server, and the offline `tokenloom run-batch` command.

Both run each JSONL line through the same handlers as the HTTP routes (endpoints.py), in process.
"""
