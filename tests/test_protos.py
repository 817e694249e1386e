"""The generated protos: wire-identical to TensorFlow's, fresh, and importable next to TF."""

from __future__ import annotations

import filecmp
import importlib.util
import os
import pathlib
import subprocess
import sys

import pytest
from google.protobuf import descriptor_pb2

from meshembed._proto import optimization_parameters_pb2 as opt_pb2
from meshembed._proto import tpu_embedding_configuration_pb2 as cfg_pb2
from meshembed.config import Adagrad, EmbeddingConfig, FeatureConfig, TableConfig
from meshembed.config.proto_io import optimizer_from_message, optimizer_to_message

ROOT = pathlib.Path(__file__).resolve().parents[1]
PROTO_DIR = ROOT / "protos"
PROTOS = ["meshembed/_proto/optimization_parameters.proto", "meshembed/_proto/tpu_embedding_configuration.proto"]
GENERATED = ["optimization_parameters_pb2.py", "optimization_parameters_pb2.pyi",
             "tpu_embedding_configuration_pb2.py", "tpu_embedding_configuration_pb2.pyi"]

# The only intended difference: TF declares `program` as xla.HloModuleProto, we as bytes.
# Both are length-delimited (wire type 2), so the bytes on the wire are the same.
BYTES_FOR_MESSAGE = {("UserDefinedProgramParameters", "program")}


def _tf_pb2():
    pytest.importorskip("tensorflow", reason="tensorflow-cpu (extra [tf-interop]) is needed to compare with TF's descriptors")
    from tensorflow.core.protobuf.tpu import optimization_parameters_pb2, tpu_embedding_configuration_pb2

    return optimization_parameters_pb2, tpu_embedding_configuration_pb2


def _file_proto(module) -> descriptor_pb2.FileDescriptorProto:
    fdp = descriptor_pb2.FileDescriptorProto()
    module.DESCRIPTOR.CopyToProto(fdp)
    return fdp


def _strip(type_name: str) -> str:
    for prefix in (".tensorflow.tpu.", ".meshembed.tpu."):
        if type_name.startswith(prefix):
            return type_name[len(prefix):]
    return type_name


def _describe_enum(e: descriptor_pb2.EnumDescriptorProto) -> dict:
    return {
        "values": [(v.name, v.number) for v in e.value],
        "reserved": [(r.start, r.end) for r in e.reserved_range],
        "reserved_names": sorted(e.reserved_name),
    }


def _describe_message(m: descriptor_pb2.DescriptorProto) -> dict:
    fields = {}
    for f in m.field:
        type_ = f.type
        type_name = _strip(f.type_name)
        if (m.name, f.name) in BYTES_FOR_MESSAGE:
            type_, type_name = "length-delimited", ""
        fields[f.number] = {
            "name": f.name,
            "type": type_,
            "type_name": type_name,
            "label": f.label,
            "oneof": m.oneof_decl[f.oneof_index].name if f.HasField("oneof_index") else None,
            "proto3_optional": f.proto3_optional,
            "json_name": f.json_name,
            "deprecated": f.options.deprecated,
            "packed": f.options.packed if f.options.HasField("packed") else None,
        }
    return {
        "fields": fields,
        "oneofs": [o.name for o in m.oneof_decl],
        "reserved": sorted((r.start, r.end) for r in m.reserved_range),
        "reserved_names": sorted(m.reserved_name),
        "enums": {e.name: _describe_enum(e) for e in m.enum_type},
        "nested": {n.name: _describe_message(n) for n in m.nested_type},
    }


def _describe_file(module) -> dict:
    fdp = _file_proto(module)
    return {
        "syntax": fdp.syntax,
        "messages": {m.name: _describe_message(m) for m in fdp.message_type},
        "enums": {e.name: _describe_enum(e) for e in fdp.enum_type},
    }


@pytest.mark.parametrize("which", ["optimization_parameters", "tpu_embedding_configuration"])
def test_descriptors_match_tensorflow(which):
    tf_opt, tf_cfg = _tf_pb2()
    theirs = {"optimization_parameters": tf_opt, "tpu_embedding_configuration": tf_cfg}[which]
    ours = {"optimization_parameters": opt_pb2, "tpu_embedding_configuration": cfg_pb2}[which]
    a, b = _describe_file(ours), _describe_file(theirs)
    assert a["syntax"] == b["syntax"] == "proto3"
    assert set(a["messages"]) == set(b["messages"])
    for name in b["messages"]:
        assert a["messages"][name] == b["messages"][name], f"message {name} differs from TensorFlow's"
    assert a == b


def test_descriptor_comparison_sees_the_bytes_exception():
    """The one declared difference really is the HLO program field, and only it."""
    tf_opt, _ = _tf_pb2()
    ours = _file_proto(opt_pb2)
    theirs = _file_proto(tf_opt)
    diffs = []
    for m_ours, m_theirs in zip(ours.message_type, theirs.message_type):
        for f_ours, f_theirs in zip(m_ours.field, m_theirs.field):
            if f_ours.type != f_theirs.type:
                diffs.append((m_ours.name, f_ours.name))
    assert set(diffs) == BYTES_FOR_MESSAGE


def test_message_counts_are_complete():
    assert len(_file_proto(opt_pb2).message_type) == 28
    assert [m.name for m in _file_proto(cfg_pb2).message_type] == ["TPUEmbeddingConfiguration", "TPUEmbeddingError"]
    oneof = opt_pb2.OptimizationParameters.DESCRIPTOR.oneofs_by_name["parameters"]
    assert len(oneof.fields) == 19


def test_generated_code_is_fresh(tmp_path):
    if importlib.util.find_spec("grpc_tools") is None:
        pytest.skip("grpcio-tools (extra [dev]) is needed to regenerate the protos")
    cmd = [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_DIR}", f"--python_out={tmp_path}",
           f"--pyi_out={tmp_path}", *PROTOS]
    subprocess.run(cmd, check=True, cwd=ROOT, capture_output=True)
    committed = ROOT / "src" / "meshembed" / "_proto"
    stale = [name for name in GENERATED
             if not filecmp.cmp(tmp_path / "meshembed" / "_proto" / name, committed / name, shallow=False)]
    assert not stale, f"generated files are stale, run `make protos`: {stale}"


@pytest.mark.parametrize("order", ["meshembed_first", "tensorflow_first"])
def test_imports_with_tensorflow_in_either_order(order):
    pytest.importorskip("tensorflow", reason="tensorflow-cpu (extra [tf-interop]) is needed for the import-order check")
    ours = ("import meshembed; from meshembed.config import EmbeddingConfig; "
            "from meshembed._proto import tpu_embedding_configuration_pb2 as m")
    theirs = "import tensorflow; from tensorflow.core.protobuf.tpu import tpu_embedding_configuration_pb2 as t"
    check = ("b = m.TPUEmbeddingConfiguration(num_hosts=3).SerializeToString(); "
             "assert t.TPUEmbeddingConfiguration.FromString(b).num_hosts == 3; print('ok')")
    code = "; ".join([ours, theirs] if order == "meshembed_first" else [theirs, ours]) + "; " + check
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                         env={**os.environ, "TF_CPP_MIN_LOG_LEVEL": "3"})
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().endswith("ok")


def test_import_meshembed_config_does_not_import_tensorflow():
    code = "import sys, meshembed.config, meshembed._proto.tpu_embedding_configuration_pb2; print('tensorflow' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"


# ---------------------------------------------------------------------------- spec §8 bytes
SPEC_MINIMAL = "0a150a0174100a18042a0c1a006a050d0000003f88010110022001280152031a0108"


def test_spec_minimal_config_bytes():
    cfg = EmbeddingConfig(
        tables=[TableConfig("t", vocabulary_size=10, dimension=4, optimizer=Adagrad(learning_rate=0.5))],
        features=[FeatureConfig(table="t", input_shape=(8,))],
        mode="training", num_hosts=1, num_tensor_cores=1)
    assert cfg.to_proto().hex() == SPEC_MINIMAL
    assert len(cfg.to_proto()) == 34
    parsed = EmbeddingConfig.from_proto(bytes.fromhex(SPEC_MINIMAL))
    assert parsed == cfg
    assert parsed.to_proto().hex() == SPEC_MINIMAL


@pytest.mark.parametrize("text, hex_", [
    ("learning_rate { dynamic { tag: 0 } } adam {}", "32006a021200"),
    ("learning_rate { dynamic { tag: 2 } } stochastic_gradient_descent {}", "22006a0412020802"),
])
def test_spec_optimization_parameters_bytes(text, hex_):
    from google.protobuf import text_format

    msg = text_format.Parse(text, opt_pb2.OptimizationParameters())
    assert msg.SerializeToString(deterministic=True).hex() == hex_
    spec = optimizer_from_message(opt_pb2.OptimizationParameters.FromString(bytes.fromhex(hex_)))
    assert spec.learning_rate.tag == int(text.split("tag: ")[1][0])
    assert optimizer_to_message(spec).SerializeToString(deterministic=True).hex() == hex_


def test_spec_tf2_adagrad_example():
    from google.protobuf import text_format

    spec = Adagrad(0.1, clipvalue=2.0, clip_weight_min=-1.0, weight_decay_factor=0.01,
                   multiply_weight_decay_factor_by_learning_rate=True)
    expected = text_format.Parse(
        "clipping_limits{lower{value:-1}} gradient_clipping_limits{lower{value:-2} upper{value:2}} "
        "learning_rate{constant:0.1} weight_decay_factor:0.01 "
        "multiply_weight_decay_factor_by_learning_rate:true gradient_accumulation_status:ENABLED adagrad{}",
        opt_pb2.OptimizationParameters())
    assert optimizer_to_message(spec) == expected
    assert spec.gradient_clipping_limits() == (-2.0, 2.0)
    assert spec.clipping_limits() == (-1.0, float("inf"))


def test_tag_zero_is_an_empty_dynamic_submessage():
    """Gotcha 5: tag 0 writes `dynamic {}` and must read back as dynamic, not as 'no lr'."""
    msg = opt_pb2.OptimizationParameters.FromString(bytes.fromhex("32006a021200"))
    assert msg.learning_rate.dynamic.tag == 0
    assert msg.learning_rate.WhichOneof("learning_rate") == "dynamic"
