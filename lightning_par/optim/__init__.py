"""Optimizers that need more than elementwise state under sharding: :class:`MuonAdamW` (Muon + AdamW)."""

from lightning_par.optim.muon import MuonAdamW, default_is_muon, muon_param_groups, muon_split

__all__ = ["MuonAdamW", "default_is_muon", "muon_param_groups", "muon_split"]
