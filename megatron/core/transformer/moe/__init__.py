"""Mixture of experts: router, experts, token dispatchers and the MoE layer."""
