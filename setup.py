"""Installable package for the Megatron-LM-compatible framework."""

from setuptools import find_packages, setup

setup(
    name="megatron-lite",
    version="0.1.0",
    description="A clean-room, Megatron-LM-compatible framework for pretraining transformer LMs",
    packages=find_packages(include=["megatron", "megatron.*"]),
    python_requires=">=3.10",
    install_requires=[
        "torch>=2.3",
        "numpy",
        "regex",
        "sentencepiece",
        "tokenizers",
        "transformers",
        "safetensors",
        "tensorboard",
        "wandb",
    ],
    extras_require={"dev": ["pytest"], "plot": ["matplotlib"]},
)
