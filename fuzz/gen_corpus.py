#!/usr/bin/env python3
"""Writes the seed corpora of the fuzzers (fuzz/corpus/<harness>/): a few
valid messages of each format, so the fuzzers start from the real layouts.

    python3 fuzz/gen_corpus.py        # rewrites fuzz/corpus/

The formats: src/transport/wire.h (message header), tcp_connect.c and tcp_handshake.c (connect
message), src/store/store.h and store_proto.h (store frames).  The input
layouts (leading flag bytes) are described at the top of each harness.
Only the generated seeds live in fuzz/corpus/; the fuzz runs work on copies
(scripts/fuzz.sh), so nothing the fuzzer finds is written back here.
"""
import os
import shutil
import struct

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "corpus")

# chorus.h enums
COLL = {"broadcast": 0, "reduce": 1, "all_reduce": 2, "send": 12}
DT = {"int8": 0, "uint8": 1, "int32": 2, "float32": 6}
SUM, NO_OP = 0, 0xFF
DATA, ABORT, BYE, PING, HEAD, PART = 1, 2, 3, 4, 5, 6
PART_MIN, PART_MAX = 128 << 10, 1 << 20
K_COLL, K_P2P = 1, 2


def hdr(typ, kind=0, ep=1, seq=0, step=0, tag=-1, coll=0, dtype=0, op=NO_OP, algo=0, root=-1,
        count=0, length=0):
    """The 56-byte message header, little-endian (wire.h)."""
    return struct.pack("<4sHHQQIiBBBBiQQ", b"CHRM", typ, kind, ep, seq, step, tag, coll, dtype,
                       op, algo, root, count, length)


def coll_msg(seq=1, step=0, payload=b"\x00" * 16, ep=1, coll="all_reduce", op=SUM, root=-1,
             count=4, length=None):
    h = hdr(DATA, K_COLL, ep, seq, step, -1, COLL[coll], DT["float32"], op, 0, root, count,
            len(payload) if length is None else length)
    return h + payload


def p2p_msg(tag, dtype, count, payload, ep=1):
    return hdr(DATA, K_P2P, ep, 0, 0, tag, COLL["send"], DT[dtype], NO_OP, 0, -1, count,
               len(payload)) + payload


def abort_msg(text, ep=1):
    return hdr(ABORT, 0, ep, length=len(text)) + text


PING_MSG = hdr(PING)
BYE_MSG = hdr(BYE)
RANK2 = b"#rank2#\n"
PIECE = b"#piece#\n"


def part_msg(msg, off, length, payload=b""):
    """A piece of message msg (tcp_io.c's piece connections): its header and
    the first bytes of it."""
    return hdr(PART, 0, msg, off, 0, 0, 0, 0, 0, 0, 0, 0, length) + payload


def frame(body):
    return struct.pack("<I", len(body)) + body


def s(b):
    return struct.pack("<I", len(b)) + b


# store commands (store_proto.h)
SET, GET, ADD, CAS, CHECK, DELETE, WAIT, NUM_KEYS = range(1, 9)


def store_seeds():
    auth_fields = b"CHST" + struct.pack("<I", 2) + bytes(range(32))
    yield "set_get", b"\x02" + frame(bytes([SET]) + s(b"key") + s(b"value")) + \
        frame(bytes([GET]) + s(b"key"))
    yield "add_check_delete", b"\x02" + frame(bytes([ADD]) + s(b"ctr") + struct.pack("<q", 5)) + \
        frame(bytes([CHECK]) + struct.pack("<I", 2) + s(b"ctr") + s(b"nope")) + \
        frame(bytes([DELETE]) + s(b"ctr")) + frame(bytes([NUM_KEYS]))
    yield "compare_set", b"\x02" + frame(bytes([CAS]) + s(b"cas") + s(b"") + s(b"first")) + \
        frame(bytes([CAS]) + s(b"cas") + s(b"first") + s(b"second"))
    yield "get_parks", b"\x02" + frame(bytes([GET]) + s(b"later")) + \
        frame(bytes([SET]) + s(b"x") + s(b"1"))
    yield "wait_parks", b"\x02" + frame(bytes([WAIT]) + struct.pack("<I", 2) + s(b"a") + s(b"b"))
    yield "add_not_integer", b"\x02" + frame(bytes([SET]) + s(b"t") + s(b"text")) + \
        frame(bytes([ADD]) + s(b"t") + struct.pack("<q", 1))
    yield "frame_over_buffer", b"\x02" + frame(bytes([SET]) + s(b"big") + s(b"v" * 8300))
    yield "partial_frame", b"\x02" + struct.pack("<I", 100) + bytes([SET]) + s(b"k")
    yield "preauth_wrong_mac", b"\x00" + frame(auth_fields + bytes(32))
    yield "preauth_old_version", b"\x00" + frame(b"CHST" + struct.pack("<I", 1) + bytes(64))
    yield "reset_after_requests", b"\x82" + frame(bytes([SET]) + s(b"r") + s(b"1"))
    yield "reset_before_auth", b"\x80" + frame(auth_fields + bytes(32))
    yield "handshake_then_requests", b"\x01" + auth_fields + \
        frame(bytes([SET]) + s(b"hk") + s(b"v")) + frame(bytes([GET]) + s(b"hk"))


def tcp_seeds():
    # flags: 1 real formatter, 2 post first, 4 late subgroup, 8 collective #2, 16 destroy order,
    # 64 encrypted records, 128 flip a bit of rank 1's first record
    yield "coll_posted", bytes([0x03, 0]) + coll_msg()
    yield "coll_unexpected_split", bytes([0x01, 7]) + coll_msg()
    yield "p2p_ping_bye", bytes([0x02, 0]) + p2p_msg(5, "uint8", 8, b"abcdefgh") + PING_MSG + \
        BYE_MSG
    yield "coll_mismatch", bytes([0x03, 0]) + coll_msg(coll="broadcast", op=NO_OP, root=1)
    yield "coll_wrong_length", bytes([0x03, 0]) + coll_msg(payload=b"\x01" * 12)
    yield "abort_late_group", bytes([0x05, 0]) + abort_msg(b"rank 1 failed") + RANK2 + \
        abort_msg(b"subgroup failed", ep=2)
    yield "two_peers", bytes([0x02, 13]) + p2p_msg(5, "uint8", 8, b"12345678") + RANK2 + \
        coll_msg(step=1, payload=b"") + p2p_msg(7, "int32", 1, b"\x07\x00\x00\x00") + \
        p2p_msg(5, "uint8", 4, b"wxyz", ep=2)
    yield "next_collective", bytes([0x09, 0]) + \
        coll_msg(seq=2, coll="broadcast", op=NO_OP, root=1) + coll_msg()
    yield "budget_pause", bytes([0x20, 0]) + coll_msg(seq=3, payload=b"", length=1 << 30)
    yield "not_a_member", bytes([0x12, 0]) + p2p_msg(5, "uint8", 4, b"abcd", ep=2)
    yield "bad_magic", bytes([0x02, 0]) + b"XHRM" + coll_msg()[4:]
    yield "encrypted_two_peers", bytes([0x42, 13]) + p2p_msg(5, "uint8", 8, b"12345678") + \
        RANK2 + coll_msg(step=1, payload=b"") + p2p_msg(7, "int32", 1, b"\x07\x00\x00\x00")
    yield "encrypted_tampered", bytes([0xc3, 0]) + coll_msg()
    # In pieces: a 2 MiB p2p message (rank 1, tag 5: unexpected, then
    # mismatched against the 8-byte receive) in two 1 MiB pieces on rank 1's
    # piece connection, which may come before or after its HEAD; a piece
    # that does not fit; pieces of no message; a HEAD too short to cut.
    big = 2 * PART_MAX
    head = hdr(HEAD, K_P2P, 1, 0, 0, 5, COLL["send"], DT["uint8"], NO_OP, 0, -1, big, big)
    yield "pieces_first", bytes([0x01, 0]) + PING_MSG + head + PIECE + \
        part_msg(1, 0, PART_MAX, b"\x11" * 64)
    yield "pieces_bad_offset", bytes([0x01, 0]) + head + PIECE + \
        part_msg(1, 4096, PART_MAX)
    yield "pieces_no_head", bytes([0x03, 0]) + p2p_msg(5, "uint8", 8, b"abcdefgh") + PIECE + \
        part_msg(1, 0, PART_MAX) + part_msg(2, 0, PART_MAX)
    yield "head_too_short", bytes([0x03, 0]) + RANK2 + \
        hdr(HEAD, K_P2P, 1, 0, 0, 7, COLL["send"], DT["int32"], NO_OP, 0, -1, PART_MAX // 4,
            PART_MAX)
    yield "unknown_endpoint", bytes([0x00, 0]) + coll_msg(ep=99) + p2p_msg(5, "uint8", 3, b"abc",
                                                                           ep=77)


def wire_seeds():
    yield "data_coll", hdr(DATA, K_COLL, 1, 1, 0, -1, COLL["all_reduce"], DT["float32"], SUM, 0,
                           -1, 4, 16)
    yield "data_p2p", hdr(DATA, K_P2P, 1, 0, 0, 5, COLL["send"], DT["uint8"], NO_OP, 0, -1, 8, 8)
    yield "abort", hdr(ABORT, length=20)
    yield "ping_bye", PING_MSG + BYE_MSG
    yield "reduce_root", hdr(DATA, K_COLL, 3, 9, 2, -1, COLL["reduce"], DT["int32"], SUM, 1, 0,
                             100, 400)


def handshake_seeds():
    def connect(rank, version=3 | 1 << 24, magic=b"CHRC"):
        # version word: version 3, connection (bits 19-23: 0 main, i + 1 piece
        # connection i) and count (bits 24-28)
        return magic + struct.pack("<II", version, rank) + bytes(range(32)) + bytes(32)
    # flags: bits 0-1 rank, 2-3 size-2, 4 fix MAC, 5 rank+1 connected, 6 other key
    yield "valid_rank1_of_3", bytes([0x14]) + connect(1)
    yield "valid_rank3_of_5_from_1", bytes([0x1d]) + connect(3)
    yield "already_connected", bytes([0x34]) + connect(1)
    yield "encrypt_flag", bytes([0x14]) + connect(1, 3 | 1 << 24 | 0x10000)
    yield "main_count_4", bytes([0x14]) + connect(1, 3 | 4 << 24)
    yield "piece_first_of_4", bytes([0x34]) + connect(1, 3 | 1 << 19 | 4 << 24)
    yield "piece_second_unasked", bytes([0x34]) + connect(1, 3 | 2 << 19 | 4 << 24)
    yield "no_count", bytes([0x14]) + connect(1, 3)
    yield "wrong_key", bytes([0x54]) + connect(2)
    yield "bad_mac", bytes([0x04]) + connect(1)
    yield "old_version", bytes([0x14]) + connect(1, 2)


def etcd_seeds():
    """Reply bodies as etcd 3.4's gateway writes them."""
    head = b'{"header":{"cluster_id":"1","member_id":"2","revision":"7","raft_term":"2"}'
    yield "absent", head + b"}"
    yield "value", head + b',"kvs":[{"key":"L3Qvaw==","create_revision":"3","mod_revision":"3",' \
        b'"version":"1","value":"aGVsbG8="}],"count":"1"}'
    yield "empty_value", head + b',"kvs":[{"key":"L3Qvaw==","create_revision":"2"}]}'
    yield "escaped", b'{"kvs":[{"value":"\\u0061Gk=","key":"x"}]}'
    yield "error", b'{"error":"etcdserver: no leader","message":"etcdserver: no leader","code":14}'
    yield "txn", head + b',"responses":[{"response_range":{"header":{},"kvs":' \
        b'[{"key":"L3Qvaw==","value":"bmV3"}],"count":"1"}}]}'


def main():
    for name, gen in (("fuzz_wire", wire_seeds), ("fuzz_tcp_recv", tcp_seeds),
                      ("fuzz_store", store_seeds), ("fuzz_handshake", handshake_seeds),
                      ("fuzz_etcd_reply", etcd_seeds)):
        d = os.path.join(OUT, name)
        shutil.rmtree(d, ignore_errors=True)
        os.makedirs(d)
        for seed, data in gen():
            assert len(data) <= 65536, seed
            with open(os.path.join(d, seed), "wb") as f:
                f.write(data)


if __name__ == "__main__":
    main()
