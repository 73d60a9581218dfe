"""qtrain: fast, memory-lean training of Llama-family language models (PyTorch + Triton); see README.md."""

__version__ = "0.1.0"
