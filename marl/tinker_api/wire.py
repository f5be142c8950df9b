"""The Tinker client's wire formats the service reads and writes: the protobuf forward/backward
request, the protobuf forward/backward and sample responses, and JSON tensors.

Decoding never trusts the client: a bad tensor or chunk is a :class:`BadRequest` naming the
datum and field, answered before any pass runs."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from tinker.proto import tinker_public_pb2 as pb


class BadRequest(ValueError):
    """The request itself is wrong (the client's error, category ``user``)."""


@dataclass
class Datum:
    """One training example: input tokens and its loss inputs, each ``[len(tokens)]``."""

    tokens: list[int]
    inputs: dict[str, torch.Tensor] = field(default_factory=dict)


@dataclass
class FwdBwdRequest:
    model_id: str
    seq_id: int
    loss_fn: str
    config: dict[str, Any]
    forward_only: bool
    data: list[Datum]


_NP = {pb.DTYPE_FLOAT32: np.float32, pb.DTYPE_INT64: np.int64, pb.DTYPE_INT32: np.int32}


def _tensor(msg: pb.Tensor, where: str) -> torch.Tensor:
    dtype = _NP.get(msg.dtype)
    if dtype is None:
        raise BadRequest(f"{where}: unsupported tensor dtype {msg.dtype}; send float32 or int64")
    shape = list(msg.shape)
    if msg.HasField("sparse_csr"):
        csr = msg.sparse_csr
        values = np.frombuffer(csr.values, dtype=dtype)
        crow = np.frombuffer(csr.crow_indices, dtype=np.int64)
        col = np.frombuffer(csr.col_indices, dtype=np.int64)
        if len(shape) != 2 or len(crow) != shape[0] + 1 or len(col) != len(values):
            raise BadRequest(f"{where}: a sparse tensor with inconsistent shape {shape}")
        dense = np.zeros(shape, dtype=dtype)
        for r in range(shape[0]):
            lo, hi = int(crow[r]), int(crow[r + 1])
            dense[r, col[lo:hi]] = values[lo:hi]
        return torch.from_numpy(dense)
    arr = np.frombuffer(msg.dense, dtype=dtype).copy()
    if shape and int(np.prod(shape)) != arr.size:
        raise BadRequest(f"{where}: shape {shape} does not match its {arr.size} values")
    return torch.from_numpy(arr.reshape(shape) if shape else arr)


def tensor_from_json(td: Any, where: str) -> torch.Tensor:
    """A JSON ``TensorData`` (dict with data, dtype, shape, optional CSR indices)."""
    dtype = {"float32": torch.float32, "int64": torch.int64}.get(td.dtype)
    if dtype is None:
        raise BadRequest(f"{where}: unsupported dtype {td.dtype!r}")
    if td.sparse_crow_indices is not None:
        dense = torch.zeros(td.shape, dtype=dtype)
        crow, col = td.sparse_crow_indices, td.sparse_col_indices or []
        values = torch.tensor(td.data, dtype=dtype)
        for r in range(len(crow) - 1):
            dense[r, torch.tensor(col[crow[r] : crow[r + 1]], dtype=torch.long)] = values[
                crow[r] : crow[r + 1]
            ]
        return dense
    t = torch.tensor(td.data, dtype=dtype)
    return t.reshape(td.shape) if td.shape else t


def decode_fwdbwd(body: bytes) -> FwdBwdRequest:
    msg = pb.ForwardBackwardRequest()
    try:
        msg.ParseFromString(body)
    except Exception as e:  # the protobuf decoder's own error types vary by backend
        raise BadRequest(
            f"forward_backward: the body is not a ForwardBackwardRequest: {e}"
        ) from None
    config: dict[str, Any] = {k: float(v) for k, v in msg.loss_fn_config.items()}
    for k, v in msg.loss_fn_config_v2.items():
        config[k] = v.text if v.WhichOneof("value") == "text" else float(v.number)
    data = []
    for i, d in enumerate(msg.data):
        tokens: list[int] = []
        for c in d.model_input:
            kind = c.WhichOneof("chunk")
            if kind != "encoded_text":
                raise BadRequest(
                    f"forward_backward: datum {i} has a {kind} chunk; this server takes "
                    "text tokens only (EncodedTextChunk)"
                )
            tokens += np.frombuffer(c.encoded_text.tokens, dtype=np.int32).tolist()
        inputs = {
            name: _tensor(t, f"datum {i} loss_fn_inputs[{name!r}]")
            for name, t in d.loss_fn_inputs.items()
        }
        data.append(Datum(tokens, inputs))
    return FwdBwdRequest(
        msg.model_id, msg.seq_id, msg.loss_fn, config, bool(msg.forward_only), data
    )


def _batched(arrays: list[np.ndarray], dtype: int) -> pb.BatchedTensor:
    flat = [np.ascontiguousarray(a).reshape(-1) for a in arrays]
    sizes = [a.nbytes for a in flat]
    offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
    data = b"".join(a.tobytes() for a in flat)
    return pb.BatchedTensor(data=data, offsets=offsets.tobytes(), dtype=dtype)


def encode_fwdbwd(outputs: list[dict[str, np.ndarray]], metrics: dict[str, float]) -> bytes:
    """A ForwardBackwardOutput: per datum float32 arrays by name, and the metrics."""
    msg = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord")
    for k, v in metrics.items():
        msg.metrics[k] = float(v)
    if outputs:
        rec = msg.loss_fn_outputs.add()
        rec.num_datums = len(outputs)
        for name in outputs[0]:
            rec.fields[name].CopyFrom(
                _batched([o[name].astype(np.float32) for o in outputs], pb.DTYPE_FLOAT32)
            )
    return msg.SerializeToString()


@dataclass
class Sequence_:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"


def encode_sample(seqs: list[Sequence_], prompt_logprobs: list[float] | None) -> bytes:
    """A SampleResponse; ``prompt_logprobs`` NaN where none (position 0)."""
    msg = pb.SampleResponse()
    for s in seqs:
        m = msg.sequences.add()
        m.stop_reason = pb.STOP_REASON_STOP if s.stop_reason == "stop" else pb.STOP_REASON_LENGTH
        m.tokens = np.asarray(s.tokens, dtype=np.int32).tobytes()
        m.logprobs = np.asarray(s.logprobs, dtype=np.float32).tobytes()
    if prompt_logprobs is not None:
        msg.prompt_logprobs = np.asarray(prompt_logprobs, dtype=np.float32).tobytes()
    return msg.SerializeToString()
