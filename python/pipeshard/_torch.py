"""PyTorch in and out: pipeshard.from_torch exports an nn.Module into a Model, and
Model.to_torch / TrainResult.to_torch copy weights back into the module by name.

The names are the link: exported in training mode without constant folding,
torch.onnx.export keeps every weight under its state_dict() name ("0.weight"), in the
module's own layout (a Linear's [out, in]; the transpose is a node, not a copied weight),
and a tied weight once, under its first name. from_torch checks that this held."""

import inspect
import io
import sys

from . import _pipeshard


def _import_torch(caller):
    try:
        import torch
    except ImportError as e:
        raise ImportError(
            f"pipeshard.{caller} needs PyTorch, which {sys.executable} cannot import: install python3-torch "
            "(Debian's PyTorch for /usr/bin/python3)"
        ) from e
    return torch


def _check_module(torch, module):
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"module must be a torch.nn.Module, not {type(module).__name__}")


def _export_defaults(torch, export_options):
    """torch.onnx.export's keywords for from_torch: `export_options` over its defaults."""
    options = {
        "export_params": True,
        "training": torch.onnx.TrainingMode.TRAINING,  # Dropout and BatchNorm as training runs them
        "do_constant_folding": False,  # folding would store transposed weights under new names
        "opset_version": 17,  # LayerNormalization as one node; torch 1.13's newest
        "input_names": ["input"],
        "output_names": ["output"],
        "dynamic_axes": {"input": {0: "batch"}, "output": {0: "batch"}},
    }
    if "input_names" in export_options or "output_names" in export_options:
        del options["dynamic_axes"]  # it names the default input and output
    # Newer torch also has the dynamo exporter (its default from 2.9); training-mode export
    # is the TorchScript exporter's.
    if "dynamo" in inspect.signature(torch.onnx.export).parameters:
        options["dynamo"] = False
    options.update(export_options)
    return options


def _with_initializers(onnx_bytes, values):
    """`onnx_bytes` (an .onnx file) with the initializers named in `values` ({name: tensor})
    holding those values."""
    try:
        import onnx
        from onnx import numpy_helper
    except ImportError as e:
        raise ImportError(
            "pipeshard.from_torch: the training-mode export stepped "
            + ", ".join(values)
            + " (BatchNorm's running statistics), and writing the module's own values back into the "
            "ONNX file needs the onnx package: install python3-onnx"
        ) from e
    proto = onnx.load_from_string(onnx_bytes)
    for t in proto.graph.initializer:
        if t.name in values:
            t.CopyFrom(numpy_helper.from_array(values[t.name].cpu().numpy(), t.name))
    return proto.SerializeToString()


def _check_names(model, module):
    """ValueError unless every weight of `model` has a state_dict() name of `module`."""
    names = set(module.state_dict())
    for name, w in model.weights().items():
        if name not in names:
            raise ValueError(
                f"torch.onnx.export stored weight '{name}' {list(w.shape)} under a name that "
                f"{type(module).__name__}.state_dict() does not have (do_constant_folding=True stores a "
                "transposed weight as a new initializer), so to_torch could not copy it back: export with "
                "do_constant_folding=False, from_torch's default"
            )


def from_torch(module, example_input, **export_options):
    """from_torch(module, example_input, **export_options) -> Model

    Exports a PyTorch module with torch.onnx.export, in memory, and imports it as
    pipeshard.load does, so that pipeshard.train can train it and result.to_torch(module)
    can copy the trained weights back.

    Arguments:
      module           a torch.nn.Module made of layers pipeshard trains (Linear, LayerNorm,
                       BatchNorm1d, Dropout, ReLU, GELU, ...). Left as it was: its weights,
                       its buffers (the export runs forward in training mode, which steps
                       BatchNorm's running statistics; they are put back, in the module and
                       in the exported file, which then needs the onnx package) and every
                       submodule's training flag.
      example_input    a tensor (or tuple of tensors) forward takes, traced by the export;
                       its batch size does not matter (train's batch_size sets it).
      export_options   torch.onnx.export's keywords, over from_torch's defaults:
                       training=TrainingMode.TRAINING (Dropout kept, BatchNorm with batch
                       statistics), do_constant_folding=False, opset_version=17,
                       export_params=True, input_names=["input"], output_names=["output"],
                       dynamic_axes with a "batch" first axis on both (left out when
                       input_names or output_names is given).

    Returns a Model whose weights are named as module.state_dict() names them ("0.weight"),
    and whose .path is "<torch ClassName>".

    Errors: ImportError without torch (install python3-torch); TypeError when `module` is
    not an nn.Module; ValueError with the importer's message for a module pipeshard cannot
    train (a convolution, say), and when the export stored a weight under a name that is no
    state_dict() name (as do_constant_folding=True does); whatever torch.onnx.export raises."""
    torch = _import_torch("from_torch")
    _check_module(torch, module)
    options = _export_defaults(torch, export_options)
    modes = [(m, m.training) for m in module.modules()]
    before = {name: b.detach().clone() for name, b in module.named_buffers()}
    data = io.BytesIO()
    try:
        torch.onnx.export(module, example_input, data, **options)
        stepped = {
            name: before[name]
            for name, b in module.named_buffers()
            if b.is_floating_point() and not torch.equal(b, before[name])
        }
    finally:
        # torch.onnx.export puts back the top module's flag only, on every submodule.
        for m, training in modes:
            m.training = training
        with torch.no_grad():
            for name, b in module.named_buffers():
                b.copy_(before[name])
    onnx_bytes = data.getvalue()
    if stepped:
        onnx_bytes = _with_initializers(onnx_bytes, stepped)
    model = _pipeshard.load(onnx_bytes, f"<torch {type(module).__name__}>")
    _check_names(model, module)
    return model


def model_to_torch(model, module):
    """Model.to_torch(module) -> module

    Copies this model's weights into a PyTorch module, in place, by name: each weight into
    the parameter or buffer of module.state_dict() with the same name. Meant for the module
    from_torch exported (or one built the same way), after pipeshard.train.

    Arguments:
      module   a torch.nn.Module with a float32 tensor of the same name and shape for every
               weight. Buffers that are not floating point (BatchNorm's num_batches_tracked)
               are not in the ONNX file and keep their values. A tensor tied under several
               names (a shared weight) is copied once, from whichever name the model has.

    Returns `module`, its training flags unchanged. Nothing is copied unless everything
    matches.

    Errors: ValueError naming the tensor when the model has a weight the module has no
    tensor for, when a float tensor of the module is not among the model's weights, or when
    their shapes differ or the module's is not float32; TypeError when `module` is not an
    nn.Module; ImportError without torch."""
    torch = _import_torch("to_torch")
    _check_module(torch, module)
    weights = model.weights()
    tensors = module.state_dict(keep_vars=True)
    kind = type(module).__name__
    for name, w in weights.items():
        if name not in tensors:
            raise ValueError(
                f"{model.path} has weight '{name}' {list(w.shape)}, and the {kind} has no tensor of that name"
            )
    names_of = {}  # id of a float tensor of the module -> (the tensor, its state_dict names)
    for name, t in tensors.items():
        if t.is_floating_point():
            names_of.setdefault(id(t), (t, []))[1].append(name)
    copies = []
    for t, names in names_of.values():
        found = [n for n in names if n in weights]
        if not found:
            raise ValueError(f"the {kind}'s '{names[0]}' {list(t.shape)} is not among the weights of {model.path}")
        for n in found:
            if tuple(t.shape) != weights[n].shape:
                raise ValueError(f"'{n}': {model.path} has {list(weights[n].shape)}, the {kind} {list(t.shape)}")
            if t.dtype != torch.float32:
                raise ValueError(f"'{n}' is {t.dtype} in the {kind}; pipeshard's weights are float32 (module.float())")
            if not (weights[n] == weights[found[0]]).all():
                raise ValueError(f"'{n}' and '{found[0]}' are one tensor in the {kind} but differ in {model.path}")
        copies.append((t, weights[found[0]]))
    with torch.no_grad():
        for t, w in copies:
            t.copy_(torch.from_numpy(w))
    return module


def result_to_torch(result, module):
    """TrainResult.to_torch(module) -> module

    result.model.to_torch(module): copies the trained weights into `module` by name, in
    place, and returns it (see Model.to_torch)."""
    return model_to_torch(result.model, module)
