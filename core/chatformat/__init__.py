"""Chat formatting with tools, shared by the worker (which renders prompts) and the API (which
builds tool grammars and parses answers): no Qt, no llama.cpp context, no I/O.

- ``template``: a GGUF's Jinja chat template rendered as llama.cpp's ``--jinja`` (and
  transformers) render it, with ``tools``; what the template can show (``TemplateCaps``, found by
  rendering probes).
- ``history``: OpenAI chat messages normalised for a template (content null -> "", tool-call
  arguments as object or string, 9-character ids for Mistral templates, tool history for templates
  without tool syntax).
- ``families``: the tool-call formats (Hermes/Qwen, Llama 3.x, Mistral, generic JSON), detected
  from the template text.
- ``grammar``: GBNF forcing a family's call syntax with arguments from the functions' JSON
  schemas (forced, or lazy with trigger patterns).
- ``schema_check``: a JSON schema's shape and limits, checked before it becomes a grammar.
- ``schema_grammar``: a JSON schema as GBNF (llama-cpp-python's converter, JSON strings without
  control characters, a root ``$ref`` followed).
- ``gbnf_check``: limits on any GBNF text, so llama.cpp builds and applies it in bounded time
  and stack (the API and the worker both check).
- ``parse``: an answer split into reasoning, content and tool calls, whole or streamed.
"""
