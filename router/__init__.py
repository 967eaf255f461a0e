"""The front door: validation, tokenization, routing, the OpenAI HTTP front, the client."""
