"""Every preset by name: plain functions that return a run config. `phalanx presets` lists them.

Each kind keeps its own presets beside its config: data-parallel presets (dp/presets.py) return a RunConfig,
pipeline presets (pipeline/presets.py) a PipelineRunConfig, Aspis presets (aspis/presets.py) an AspisRunConfig.
"""

from __future__ import annotations

from collections.abc import Callable

from ..core.errors import ConfigError
from .aspis.presets import ASPIS_PRESETS
from .dp.presets import DP_PRESETS
from .pipeline.presets import PIPELINE_PRESETS

PRESETS: dict[str, Callable[[], object]] = {**DP_PRESETS, **PIPELINE_PRESETS, **ASPIS_PRESETS}


def get_preset(name: str):
    """The config the preset `name` returns (a RunConfig, PipelineRunConfig or AspisRunConfig)."""
    if name not in PRESETS:
        raise ConfigError(f"unknown preset {name!r}; run 'phalanx presets' to list them: {', '.join(PRESETS)}")
    return PRESETS[name]()


def describe() -> list[tuple[str, str]]:
    """(name, one-line description) of every preset."""
    return [(name, (fn.__doc__ or "").strip().splitlines()[0]) for name, fn in PRESETS.items()]
