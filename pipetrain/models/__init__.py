"""Plain single-device decoder models; parallelism is applied from outside (pipetrain.parallel)."""
import torch

from pipetrain.config import ModelConfig
from pipetrain.models.decoder import Decoder, count_params, flops_per_token
from pipetrain.models.init import materialize, param_layout


def build(cfg: ModelConfig, device: str | torch.device = "meta") -> Decoder:
    """Build the decoder for cfg; on "meta" no memory is allocated (see materialize())."""
    with torch.device(device):
        return Decoder(cfg)


__all__ = ["Decoder", "build", "count_params", "flops_per_token", "materialize", "param_layout"]
