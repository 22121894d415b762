"""CUDA-simulator tests (see conftest.py)."""
