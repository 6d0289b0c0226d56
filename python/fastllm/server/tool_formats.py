"""The tool-call formats of chat replies (``tools.py`` reads and forces
each), by vLLM's ``--tool-call-parser`` names: a module of their own, so the
command line lists them without importing the server's dependencies."""

FORMATS = (
    "hermes",
    "llama3_json",
    "mistral",
    "qwen3_coder",
    "granite",
    "phi4_mini_json",
    "openai",
    "json",
)
#: ``--tool-call-parser``'s choices: a format, or ``auto``, the one the chat template writes.
TOOL_CALL_PARSERS = ("auto", *FORMATS)
