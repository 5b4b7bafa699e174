"""Target model architectures and their checkpoint loader."""

from metrale.workers.models.config import ARCHITECTURES, CheckpointError, ModelConfig
from metrale.workers.models.decoder import CausalLM
from metrale.workers.models.loader import load_model

__all__ = ["ARCHITECTURES", "CausalLM", "CheckpointError", "ModelConfig", "load_model"]
