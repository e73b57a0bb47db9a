"""Installable package for the Megatron-LM-compatible framework."""

from setuptools import find_packages, setup

setup(
    name="megatron-lite",
    version="0.1.0",
    description="A clean-room, Megatron-LM-compatible framework for pretraining transformer LMs",
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.10",
    # Ranges for the libraries whose APIs the code and tests call (tested with torch 2.13,
    # transformers 5.24, tokenizers 0.23, sentencepiece 0.2.3, numpy 2.4, safetensors 0.8);
    # constraints.txt pins the CPU build of torch.
    install_requires=[
        "torch>=2.3",
        "numpy>=1.26,<3",
        "regex",
        "sentencepiece>=0.2,<0.3",
        "tokenizers>=0.22,<0.24",
        # transformers 5: GPT2Tokenizer(vocab=, merges=) and the v5 model classes.
        "transformers>=5.0,<6",
        "safetensors>=0.4.3,<1",
        "tensorboard",
        "wandb",
        # The text generation server (tools/run_text_generation_server.py).
        "flask>=2.2,<4",
    ],
    extras_require={
        # Everything `make test` needs, so that no test is skipped on a fresh machine.
        "dev": [
            "pytest>=8",
            "pytest-timeout>=2.2",
            "pytest-xdist>=3.5",
            "matplotlib>=3.8",
            "ruff>=0.6",
        ],
        "plot": ["matplotlib>=3.8"],
    },
)
