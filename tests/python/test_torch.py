# PyTorch in and out: pipeshard.from_torch exports a module, train trains it, and
# result.to_torch(module) puts the trained weights back by name, bit for bit as the saved
# ONNX file has them; pipeshard.load of an onnx.ModelProto is load of its file. Skipped,
# test by test, where torch is not installed for this python.
import sys

import numpy as np
import onnx
import onnx.numpy_helper
import pytest

import pipeshard
from conftest import SOURCE


@pytest.fixture
def torch():
    return pytest.importorskip("torch", reason="PyTorch is not installed for this python (Debian: python3-torch)")


def layernorm_mlp(torch):
    """Linear(16, 32), LayerNorm(32), ReLU, Dropout(0.1), Linear(32, 4): 16 features, 4 classes."""
    nn = torch.nn
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4))


def batchnorm_mlp(torch):
    nn = torch.nn
    torch.manual_seed(1)
    return nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 4))


def data(features=16, classes=4, samples=256):
    rng = np.random.default_rng(0)
    X = rng.standard_normal((samples, features), dtype=np.float32)
    return X, (np.arange(samples) % classes).astype(np.int64)


def initializers(path):
    return {t.name: onnx.numpy_helper.to_array(t) for t in onnx.load(str(path)).graph.initializer}


def state(module):
    return {name: t.detach().clone() for name, t in module.state_dict().items()}


def test_round_trip_is_bit_for_bit(torch, tmp_path):
    module = layernorm_mlp(torch)
    initial = state(module)
    model = pipeshard.from_torch(module, torch.zeros(1, 16))
    assert model.path == "<torch Sequential>"
    assert sorted(model.weights()) == sorted(initial)  # state_dict names: "0.weight", "1.bias", ...
    assert model.parameter_count == sum(p.numel() for p in module.parameters())

    result = pipeshard.train(model, *data(), optimizer="adamw", batch_size=32, steps=8, seed=1)
    assert result.to_torch(module) is module
    result.model.save(str(tmp_path / "trained.onnx"))
    saved = initializers(tmp_path / "trained.onnx")
    trained = module.state_dict()
    assert saved.keys() == trained.keys()
    for name, t in trained.items():
        assert t.dtype == torch.float32 and np.array_equal(t.numpy(), saved[name]), name
        assert not torch.equal(t, initial[name]), f"training left {name} as it was"


def test_batchnorm_statistics_and_counter(torch, tmp_path):
    module = batchnorm_mlp(torch)
    with torch.no_grad():  # statistics other than the defaults, to see them kept
        module[1].running_mean.uniform_(-0.5, 0.5)
        module[1].running_var.uniform_(0.5, 2.0)
    initial = state(module)
    model = pipeshard.from_torch(module, torch.zeros(2, 16))
    # The training-mode export ran forward, which steps the running statistics: put back,
    # in the module and in the exported weights.
    for name, t in module.state_dict().items():
        assert torch.equal(t, initial[name]), name
    weights = model.weights()
    assert sorted(weights) == sorted(n for n in initial if n != "1.num_batches_tracked")
    for name, w in weights.items():
        assert np.array_equal(w, initial[name].numpy()), name

    result = pipeshard.train(model, *data(), batch_size=32, steps=4)
    result.to_torch(module)
    result.model.save(str(tmp_path / "trained.onnx"))
    saved = initializers(tmp_path / "trained.onnx")
    for name, w in saved.items():
        assert np.array_equal(module.state_dict()[name].numpy(), w), name
    assert not torch.equal(module[1].running_mean, initial["1.running_mean"])
    assert torch.equal(module[1].num_batches_tracked, initial["1.num_batches_tracked"])  # not in ONNX: kept


def test_linear_without_bias_and_a_tied_weight(torch):
    nn = torch.nn

    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(16, 16, bias=False), nn.Linear(16, 16)
            self.fc2.weight = self.fc1.weight  # one tensor, two state_dict names
            self.head = nn.Linear(16, 4)

        def forward(self, x):
            return self.head(torch.relu(self.fc2(torch.relu(self.fc1(x)))))

    torch.manual_seed(2)
    module = Tied()
    model = pipeshard.from_torch(module, torch.zeros(1, 16))
    # A Linear without bias is Transpose + MatMul: the weight is kept as [out, in] under its
    # name. The tied weight is one initializer, under its first name.
    weights = model.weights()
    assert sorted(weights) == ["fc1.weight", "fc2.bias", "head.bias", "head.weight"]
    assert weights["fc1.weight"].shape == (16, 16)
    result = pipeshard.train(model, *data(), batch_size=32, steps=4)
    result.to_torch(module)
    assert module.fc2.weight is module.fc1.weight
    assert np.array_equal(module.fc1.weight.detach().numpy(), result.model.weights()["fc1.weight"])


def test_load_of_a_model_proto_is_load_of_its_file():
    path = SOURCE / "models" / "layernorm_op17.onnx"
    from_file = pipeshard.load(path)
    from_proto = pipeshard.load(onnx.load(str(path)))
    assert from_proto.path == "<ModelProto>"
    assert from_proto.parameter_count == from_file.parameter_count and from_proto.layers == from_file.layers
    want = from_file.weights()
    got = from_proto.weights()
    assert got.keys() == want.keys()
    for name, w in want.items():
        assert np.array_equal(got[name], w), name
    with pytest.raises(TypeError, match="onnx.ModelProto"):
        pipeshard.load(3)
    broken = onnx.load(str(path))
    broken.graph.node[0].op_type = "Conv"
    with pytest.raises(ValueError, match="^<ModelProto>: node"):
        pipeshard.load(broken)


def test_to_torch_of_another_shape_names_the_tensor(torch):
    nn = torch.nn
    result = pipeshard.train(pipeshard.from_torch(layernorm_mlp(torch), torch.zeros(1, 16)), *data(), steps=1)
    wider = nn.Sequential(nn.Linear(16, 64), nn.LayerNorm(64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 4))
    before = state(wider)
    with pytest.raises(ValueError, match=r"'0\.weight': <torch Sequential> has \[32, 16\], the Sequential \[64, 16\]"):
        result.to_torch(wider)
    assert all(torch.equal(t, before[n]) for n, t in wider.state_dict().items())  # nothing copied
    extra = nn.Sequential(*layernorm_mlp(torch), nn.ReLU(), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"Sequential's '6\.weight' \[4, 4\] is not among the weights"):
        result.to_torch(extra)
    fewer = nn.Sequential(nn.Linear(16, 32), nn.LayerNorm(32), nn.ReLU(), nn.Dropout(0.1), nn.Linear(32, 4, bias=False))
    with pytest.raises(ValueError, match=r"has weight '4\.bias' \[4\], and the Sequential has no tensor"):
        result.to_torch(fewer)
    with pytest.raises(ValueError, match=r"'0\.weight' is torch\.float64"):
        result.to_torch(layernorm_mlp(torch).double())
    with pytest.raises(TypeError, match="torch.nn.Module"):
        result.to_torch({"0.weight": None})


def test_from_torch_refuses_what_the_importer_refuses(torch):
    nn = torch.nn
    conv = nn.Sequential(nn.Conv1d(1, 4, 3), nn.Flatten(), nn.Linear(56, 4))
    with pytest.raises(ValueError, match=r"^<torch Sequential>: node '/0/Conv' \(Conv\): a convolution"):
        pipeshard.from_torch(conv, torch.zeros(1, 1, 16))
    with pytest.raises(TypeError, match="torch.nn.Module"):
        pipeshard.from_torch(lambda x: x, torch.zeros(1, 16))


def test_constant_folding_renames_a_weight_and_is_refused(torch):
    nn = torch.nn
    module = nn.Sequential(nn.Linear(16, 32, bias=False), nn.ReLU(), nn.Linear(32, 4))
    # Folding stores the first weight transposed, [16, 32], as "onnx::MatMul_<n>".
    with pytest.raises(ValueError, match=r"stored weight 'onnx::MatMul_\d+' \[16, 32\].*do_constant_folding=False"):
        pipeshard.from_torch(module, torch.zeros(1, 16), do_constant_folding=True)


def test_export_options_pass_through(torch):
    module = layernorm_mlp(torch)
    decomposed = pipeshard.from_torch(module, torch.zeros(1, 16), opset_version=14, input_names=["x"])
    assert decomposed.parameter_count == pipeshard.from_torch(module, torch.zeros(1, 16)).parameter_count
    with pytest.raises(TypeError):  # torch.onnx.export refuses a keyword it does not know
        pipeshard.from_torch(module, torch.zeros(1, 16), no_such_option=1)


@pytest.mark.parametrize("mode", ["train", "eval", "mixed"])
def test_from_torch_leaves_the_training_flags(torch, mode):
    module = layernorm_mlp(torch)
    module.train(mode != "eval")
    if mode == "mixed":
        module[3].eval()  # the Dropout alone: torch.onnx.export would set it back to train
    flags = [m.training for m in module.modules()]
    pipeshard.from_torch(module, torch.zeros(1, 16))
    assert [m.training for m in module.modules()] == flags


def test_without_torch_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "torch", None)  # import torch raises ImportError
    with pytest.raises(ImportError, match="install python3-torch"):
        pipeshard.from_torch(object(), None)
