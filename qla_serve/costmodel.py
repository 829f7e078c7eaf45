"""Per-arch prefill cost models (configs/costmodel/<arch>.yaml), pydantic-validated.

The planner (qla_serve.plan) scores each candidate strategy with :meth:`CostModel.estimate_us`
and keeps the cheapest. The model is deliberately small (a per-chunk and a per-block time per V
split, a launch cost, a CP surcharge) so its coefficients can be fitted from one sweep on a device.
"""

from __future__ import annotations

import functools
from importlib import resources
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class CostModel(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    arch: str = Field(description="sm90 or sm100")
    sm_count: int = Field(gt=0, description="SMs assumed when the device is not asked")
    chunk_us: dict[int, float] = Field(description="GPU time of one 64-token chunk for one block, by V split")
    item_us: dict[int, float] = Field(
        default_factory=dict, description="GPU time of one stage-2 block besides its chunks (its start, the state "
        "in and out), by V split; blocks pay it a wave (sm_count blocks) at a time; 0 for a split without an entry")
    launch_us: float = Field(ge=0)
    stage1_us: float | dict[int, float] = Field(
        default=0.0, description="state-free stage per (chunk, v-head), per SM; by V split where the split's "
        "stage-2 kernel takes another stage-1 form (sm90: v_split 4 runs v8, whose prep makes U0 and Wk)")
    cp_fixed_us: float = Field(ge=0, description="extra launches of the CP path (maps pass, scan)")
    cp_maps_ratio: float = Field(gt=0, description="per-chunk time of the CP maps pass over chunk_us")
    cp_level_us: float = Field(
        default=0.0, ge=0, description="per scan step of a cut (segments - 2 of the most-cut sequence): the "
        "scan's step plus the fixed cost of shorter segments that the chunk terms miss")
    cp_segment_chunks: list[int] = Field(min_length=1, description="candidate segment lengths L (chunks)")
    cp_maps_v_splits: dict[int, int] = Field(
        default_factory=dict, description="v_split -> a narrower split the CP maps pass may run at under a plan "
        "at that v_split (its kernel must read the same stage-1 form); taken where the maps blocks expected to "
        "do work fit on the SMs in one wave at it (qla_serve.plan._maps_v_split)")
    cp_exact_fraction: float = Field(
        default=1.0, ge=0, le=1, description="share of the v-heads the planner expects on the exact CP path "
        "under cp='auto' (the others take the gate warmup, which the device decides); 1 under cp='exact'")
    fitted: bool = Field(description="true once the figures come from a device sweep")

    @field_validator("chunk_us")
    @classmethod
    def _splits(cls, v: dict[int, float]) -> dict[int, float]:
        if 1 not in v or any(s not in (1, 2, 4) for s in v) or any(t <= 0 for t in v.values()):
            raise ValueError("chunk_us needs key 1 and only keys 1, 2, 4 with positive times")
        return v

    @field_validator("item_us")
    @classmethod
    def _items(cls, v: dict[int, float]) -> dict[int, float]:
        if any(s not in (1, 2, 4) for s in v) or any(t < 0 for t in v.values()):
            raise ValueError("item_us: keys 1, 2, 4 with times >= 0")
        return v

    @field_validator("stage1_us")
    @classmethod
    def _stage1(cls, v: float | dict[int, float]) -> float | dict[int, float]:
        times = v.values() if isinstance(v, dict) else [v]
        if any(t < 0 for t in times) or (isinstance(v, dict) and any(s not in (1, 2, 4) for s in v)):
            raise ValueError("stage1_us: a time >= 0, or one per V split (keys 1, 2, 4)")
        return v

    @model_validator(mode="after")
    def _stage1_covers_splits(self) -> "CostModel":
        if isinstance(self.stage1_us, dict) and set(self.chunk_us) - set(self.stage1_us):
            raise ValueError(f"stage1_us: needs an entry for every split of chunk_us {sorted(self.chunk_us)}")
        return self

    def stage1_for(self, v_split: int) -> float:
        """The state-free stage's time per (chunk, v-head) per SM when stage 2 runs at v_split."""
        if isinstance(self.stage1_us, dict):
            if v_split not in self.stage1_us:
                raise ValueError(f"stage1_us has no entry for v_split {v_split}")
            return self.stage1_us[v_split]
        return self.stage1_us

    @field_validator("cp_maps_v_splits")
    @classmethod
    def _maps_splits(cls, v: dict[int, int]) -> dict[int, int]:
        if any(a not in (1, 2, 4) or b not in (1, 2, 4) or b <= a for a, b in v.items()):
            raise ValueError("cp_maps_v_splits: v_split -> a larger split, both in 1, 2, 4")
        return v

    @field_validator("cp_segment_chunks")
    @classmethod
    def _lengths(cls, v: list[int]) -> list[int]:
        if any(L < 2 for L in v):
            raise ValueError("cp_segment_chunks entries must be >= 2 chunks")
        return sorted(set(v))

    def estimate_us(self, v_split: int, chain_chunks: int, total_block_chunks: int,
                    sm_count: int, cut: bool, chunk_heads: int = 0, blocks: int = 0,
                    chain_blocks: int = 1) -> float:
        """Modelled GPU time of one prefill call (see the YAML header for the formula).

        ``chain_chunks``: the longest block's walk, and ``chain_blocks`` how many blocks walk
        that long; ``total_block_chunks``: all blocks' chunks; ``blocks``: the stage-2 pass's
        blocks (sequences or segments x v-heads x v_split), each paying item_us once (0: no
        item term); ``chunk_heads`` = chunks x v-heads, the state-free stage's work.
        """
        chunk, item = self.chunk_us[v_split], self.item_us.get(v_split, 0.0) if blocks else 0.0
        # Stage 2 takes the longer of: the longest blocks, a wave of them at a time (a batch of
        # equal blocks runs in whole waves), and all blocks' work spread evenly over the SMs.
        longest = -(-chain_blocks // sm_count) * (chunk * chain_chunks + item)
        spread = chunk * -(-total_block_chunks // sm_count) + item * -(-blocks // sm_count)
        return (max(longest, spread) + self.stage1_for(v_split) * chunk_heads / sm_count + self.launch_us
                + (self.cp_fixed_us if cut else 0.0))


ARCHES = ("sm90", "sm100")


@functools.lru_cache(maxsize=None)
def load_cost_model(arch: str) -> CostModel:
    """The packaged cost model for ``arch`` ("sm90" or "sm100")."""
    if arch not in ARCHES:
        raise ValueError(f"arch: expected one of {ARCHES}, got {arch!r}")
    text = config_path("costmodel", f"{arch}.yaml").read_text()
    return CostModel.model_validate(yaml.safe_load(text))


def config_path(*parts: str):
    """A file under configs/: the source checkout's (also on PYTHONPATH-only setups such as the
    device bundle), else the copy installed as the package ``qla_serve.configs``."""
    checkout = Path(__file__).resolve().parent.parent / "configs"
    if (checkout / "__init__.py").is_file():
        return checkout.joinpath(*parts)
    return resources.files("qla_serve.configs").joinpath(*parts)
