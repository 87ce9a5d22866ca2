"""Prefill/decode disaggregation across processes and machines: the hand-off (both of vllm-ascend's schemes), its
transport (pyzmq), a server's connector (--kv-transfer-config) and the proxy (`mtpserve proxy`)."""
