"""Placeholder: the per-rule thresholds (replaced by the rule engine's own module)."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class RulesConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
