"""The frame header of xla_ext/protocol.h, restated for tests that speak the
protocol by hand (a raw worker, a hostile peer): 48 bytes, little-endian."""

import struct

HEADER = struct.Struct("<IHHQQIBBHIIII")  # ... dtype, flags, param (topk's keep), sender, aux, nbytes, routes
MAGIC, VERSION = 0x5350424A, 6  # 2: the onebit dtype; 3: topk; 4: the dtype's param; 5: kStall; 6: route epochs
HELLO, HELLO_OK, PUSH, ERROR, BYE, TREE, PUSH_SHM, SHM_OFFER, SHM_ACCEPT = 1, 2, 3, 6, 7, 8, 10, 13, 14
TOPK = 6  # the topk dtype, whose param is the values each record keeps


def frame(type_, token, key=0, round_=0, dtype=0, sender=0, nbytes=0, magic=MAGIC, version=VERSION, param=0, aux=0):
    return HEADER.pack(magic, version, type_, token, key, round_, dtype, 0, param, sender, aux, nbytes, 0)
