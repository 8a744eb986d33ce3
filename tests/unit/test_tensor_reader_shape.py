"""checkpoint.read.TensorReader.read: a tensor whose shape in the checkpoint is not the model's is
refused in one line (global_shape), where a box of it would load part of a larger tensor. Only an e2e test
(tests/e2e/test_checkpoint.py) saw the check; here it is checked without processes."""
import pytest
import torch
from safetensors.torch import save_file

from pipetrain.checkpoint.read import TensorReader
from pipetrain.config import ConfigError


def _reader(tmp_path):
    w = torch.arange(24, dtype=torch.float32).reshape(6, 4)
    save_file({"model/w": w}, str(tmp_path / "rank0.safetensors"))
    manifest = {"tensors": {"model/w": {"global_shape": [6, 4], "dtype": "float32",
                                        "pieces": [{"file": "rank0.safetensors", "offsets": [0, 0],
                                                    "shape": [6, 4]}]}}}
    return TensorReader(str(tmp_path), manifest, verify=False), w


def test_a_box_of_a_tensor_of_the_models_shape_is_read(tmp_path):
    reader, w = _reader(tmp_path)
    torch.testing.assert_close(reader.read("model/w", [2, 0], [3, 4], global_shape=(6, 4)), w[2:5])
    torch.testing.assert_close(reader.read("model/w", [0, 0], [6, 4], global_shape=torch.Size([6, 4])), w)


@pytest.mark.parametrize("model_shape", [(8, 4), (4, 4), (6, 2), (6, 4, 1)])
def test_a_tensor_saved_with_another_shape_is_refused_even_where_the_box_fits(tmp_path, model_shape):
    reader, _ = _reader(tmp_path)
    with pytest.raises(ConfigError, match=r"tensor model/w has shape \[6, 4\] there and "
                                          rf"\[{', '.join(map(str, model_shape))}\] in this recipe's model"):
        reader.read("model/w", [0] * len(model_shape), [min(4, n) for n in model_shape][:2] + [1] *
                    (len(model_shape) - 2), global_shape=model_shape)
