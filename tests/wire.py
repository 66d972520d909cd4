"""The frame header of xla_ext/protocol.h, restated for tests that speak the
protocol by hand (a raw worker, a hostile peer): 48 bytes, little-endian."""

import struct

HEADER = struct.Struct("<IHHQQIB3sIIQ")
MAGIC, VERSION = 0x5350424A, 3  # version 2: the onebit dtype; 3: topk
HELLO, HELLO_OK, PUSH, ERROR, BYE, TREE, PUSH_SHM, SHM_OFFER, SHM_ACCEPT = 1, 2, 3, 6, 7, 8, 10, 13, 14


def frame(type_, token, key=0, round_=0, dtype=0, sender=0, nbytes=0, magic=MAGIC, version=VERSION):
    return HEADER.pack(magic, version, type_, token, key, round_, dtype, b"\0\0\0", sender, 0, nbytes)
