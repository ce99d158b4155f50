"""POST /v1/responses (OpenAI's Responses API) as a translation onto the chat completions machinery."""
