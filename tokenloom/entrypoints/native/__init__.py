"""The native APIs of local LLM servers, as thin translations onto the OpenAI handlers.

Desktop tools speak Ollama's ``/api/*`` and llama.cpp users' scripts call llama-server's
``/completion``; each request here is turned into an OpenAI chat or completion request, run by the
same handler that serves ``/v1`` (template, tokenizer, engine, tool and reasoning parsers, structured
outputs), and its JSON or SSE answer is reshaped into the other server's shape.
"""
