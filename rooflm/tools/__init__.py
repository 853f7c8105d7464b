"""Tool (function) calling: what the model is asked to write, and reading it back.

  parsers.py   a parser per chat-template family turns the model's text into tool calls:
               Hermes / Qwen (<tool_call>{...}</tool_call>) and Llama 3.1+ JSON
               ({"name": ..., "parameters": ...}); whole texts and streams
  choice.py    tool_choice "required" and a named function as a JSON schema, so the
               structured-output machinery makes the arguments always parse
"""
