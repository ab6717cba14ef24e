"""GGUF files: the one file check (``modelfile``), the header reader (``header``), the models
already on this machine (``catalog``), and the architectures the installed llama.cpp loads
(``llama_archs``). No llama objects: the app process and the worker both use it."""
