"""Generated protobuf code (do not edit; regenerate with `make protos`).

Wire-identical to TensorFlow's tensorflow.tpu protos; see protos/meshembed/_proto/.
"""
