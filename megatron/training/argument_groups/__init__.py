"""Flag definitions of megatron/training/arguments.py, one module per family of groups.

Every `_add_<x>_args(parser)` function adds one argparse group with Megatron's flag names,
dests, types and defaults and returns the parser. Nothing here imports torch.
"""
