"""The NVRTC launcher's driver structs and argument marshalling (CPU: no launch)."""

import ctypes

import torch

from rooflm.kernels import nvrtc


def test_the_launch_structs_have_cuda_h_sizes():
    # CUlaunchAttribute: a 4-byte id padded to 8, then a 64-byte union; CUlaunchConfig: 7 uints,
    # the stream, the attribute pointer and their count, as cuda.h lays them out on 64-bit hosts
    assert ctypes.sizeof(nvrtc._LaunchAttribute) == 72
    assert ctypes.sizeof(nvrtc._LaunchConfig) == 56
    assert nvrtc._LaunchConfig.stream.offset == 32 and nvrtc._LaunchConfig.num_attrs.offset == 48


def test_arguments_pack_as_a_c_struct_of_them():
    import struct

    t = torch.zeros(4)
    # int, pointer (padded to 8), float, int, float: C's layout of struct {int; void*; float; int; float;}
    packed = nvrtc.pack_args([7, t, 0.125, True, 2.5])
    assert len(packed) == 4 + 4 + 8 + 4 + 4 + 4
    assert struct.unpack_from("<i", packed, 0)[0] == 7
    assert struct.unpack_from("<Q", packed, 8)[0] == t.data_ptr()
    assert struct.unpack_from("<f", packed, 16)[0] == 0.125
    assert struct.unpack_from("<i", packed, 20)[0] == 1
    assert struct.unpack_from("<f", packed, 24)[0] == 2.5


def test_every_csrc_kernel_ships_as_package_data():
    assert {p.name for p in nvrtc.CSRC.glob("*.cu")} >= {"w4a16_mma.cu", "fp8_decode_attention.cu"}
    assert (nvrtc.CSRC / "cp_async.cuh").exists()


def test_local_includes_are_inlined_for_nvrtc():
    for source in ("w4a16_mma.cu", "fp8_decode_attention.cu"):
        text = nvrtc.source_text(source)
        assert "#include" not in text and "cp.async.commit_group" in text and "cp_async_wait" in text
