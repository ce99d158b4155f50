"""Speculative decoding: proposers draft tokens, the target verifies them in the same flat batch."""
