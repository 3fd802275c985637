"""pipeshard.load: the extension's load, which also takes an onnx.ModelProto."""

from . import _pipeshard

# Model.path of a model given as a ModelProto (one given as bytes is "<bytes>").
MODEL_PROTO_LABEL = "<ModelProto>"


def load(source):
    """load(source) -> Model

    Imports an ONNX MLP as `partition` and `train` read it.

    Arguments:
      source   a path (str or os.PathLike) to an .onnx file (external data is read from
               beside it), the bytes of one, or an onnx.ModelProto (anything with
               SerializeToString(), serialised here; its weights must be inside it).

    Returns a Model: .weights() ({initializer name: float32 array}), .save(path),
    .partition(...), .parameter_count, .layers, and .path, the file's path, "<bytes>" or
    "<ModelProto>", which names the model in messages.

    Errors: ValueError with the importer's one-line message for a model pipeshard cannot
    train (an unsupported op, a malformed file); TypeError for any other kind of source."""
    serialize = getattr(source, "SerializeToString", None)
    if callable(serialize):
        return _pipeshard.load(serialize(), MODEL_PROTO_LABEL)
    return _pipeshard.load(source)
