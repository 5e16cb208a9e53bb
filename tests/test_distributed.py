"""sparse_lm.distributed.detect: which multi-host start-up applies, from the environment."""

from sparse_lm.distributed import detect


def test_libtpu_warning_text_is_not_a_host_list():
  # What libtpu leaves in the variable on a machine without TPU metadata.
  warning = ("WARNING: could not determine TPU worker hostnames or IP addresses, please set env "
             "var `TPU_WORKER_HOSTNAMES` manually, otherwise libtpu.so may not properly "
             "initialize.")
  assert detect({"TPU_WORKER_HOSTNAMES": warning}) == (None, {})


def test_multi_host_tpu_slice_and_explicit_coordinator():
  assert detect({"TPU_WORKER_HOSTNAMES": "10.0.0.2,10.0.0.3"})[0] == "tpu"
  kind, kw = detect({"JAX_COORDINATOR_ADDRESS": "10.0.0.2:1234", "JAX_NUM_PROCESSES": "2",
                     "JAX_PROCESS_ID": "1"})
  assert kind == "explicit" and kw == {"coordinator_address": "10.0.0.2:1234",
                                       "num_processes": 2, "process_id": 1}
  assert detect({}) == (None, {})
