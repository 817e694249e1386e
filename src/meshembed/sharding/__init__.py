"""Sharding: row placement of embedding tables (pure) and the dense mesh/layout types."""

from meshembed.sharding.placement import STRATEGIES, Placement, shard, unshard

__all__ = ["STRATEGIES", "Placement", "shard", "unshard"]
