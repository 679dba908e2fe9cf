"""The typed config schema, registered in Hydra's ConfigStore as `schema`.

`conf/config.yaml` lists `schema` first in its defaults, so every YAML value and command-line
override is checked against these dataclasses before any work starts: a misspelled key
(`loader.num_worker=3`) or a wrong type (`epochs=ten`) fails with Hydra's own message.
Groups whose keys depend on the chosen `_target_` (data, model, optim) stay open (`Any`).
"""

from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Optional

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING


class Device(str, Enum):
    auto = "auto"
    cpu = "cpu"
    cuda = "cuda"


class RngMode(str, Enum):
    per_sample = "per_sample"
    per_worker = "per_worker"


class OnBudget(str, Enum):
    adjust = "adjust"  # lower prefetch_factor, then num_workers, until the prefetch plan fits
    error = "error"  # refuse to start instead


@dataclass
class LoaderConfig:
    batch_size: int = 64
    num_workers: Any = 2  # int, or "auto" for the CPUs this process may use
    prefetch_factor: Optional[int] = 2
    pin_memory: Any = "auto"  # true, false, or "auto" (on when training on CUDA)
    persistent_workers: bool = True
    timeout: float = 0.0
    max_prefetch_mib: Optional[float] = None  # budget for batches in flight (see memory.py); None = no budget
    on_budget: OnBudget = OnBudget.adjust


@dataclass
class ScheduleConfig:
    warmup_steps: int = 50
    min_lr_ratio: float = 0.01


@dataclass
class CheckpointConfig:
    every_steps: Optional[int] = None
    keep: int = 3
    search_dir: str = "outputs"


@dataclass
class MonitorConfig:
    every_steps: int = 50  # worker/memory/fd health sample every N steps (and at each epoch end); 0 = epoch ends only


@dataclass
class Config:
    seed: int = 0
    epochs: int = 8
    max_steps: Optional[int] = None
    resume: Optional[str] = None
    resume_strict: bool = True
    device: Device = Device.auto
    deterministic: bool = True
    amp: Any = "off"  # off | bf16 | fp16; true/false (older configs) mean fp16/off
    channels_last: bool = False
    compile: bool = False
    device_prefetch: bool = True
    log_every_steps: int = 10
    progress: bool = True
    rng_mode: RngMode = RngMode.per_sample
    loader: LoaderConfig = field(default_factory=LoaderConfig)
    schedule: ScheduleConfig = field(default_factory=ScheduleConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    data: Any = MISSING
    model: Any = MISSING
    optim: Any = MISSING


def register() -> None:
    ConfigStore.instance().store(name="schema", node=Config)
