#!/usr/bin/env python3
"""Writes the seed corpus of fuzz_npy into fuzz/corpus/npy/ (standard library only).

Seeds: the first rows of each data/*.npy file, re-headed so that they stay valid; arrays
that fit the fuzz harness's two models ([N, 4] and [N, 2, 2] features, [N] labels, [N, 3]
and [N, 2, 2] targets); and headers the reader must refuse (big-endian, bool, Fortran
order, format 2.0 and 3.0, 0-d and empty arrays, damaged headers). Run it again after
changing this list; the output is deterministic. It replaces only the *.npy files: the
corpus files named by SHA-1 are inputs fuzzing added, and stay.
"""
import ast
import pathlib
import struct

ROOT = pathlib.Path(__file__).resolve().parent.parent
OUT = ROOT / "fuzz" / "corpus" / "npy"
SIZES = {"<f4": 4, "<i8": 8, "<i4": 4, ">f4": 4, "|b1": 1, "<f8": 8, "<u1": 1}


def header_text(descr, shape, fortran=False):
    dims = ", ".join(str(d) for d in shape) + ("," if len(shape) == 1 else "")
    return "{'descr': '%s', 'fortran_order': %s, 'shape': (%s), }" % (descr, fortran, dims)


def npy(descr, shape, data=None, fortran=False, version=1, text=None):
    text = header_text(descr, shape, fortran) if text is None else text
    length_bytes = 2 if version == 1 else 4
    pad = (-(10 + (length_bytes - 2) + len(text) + 1)) % 64
    head = (text + " " * pad + "\n").encode("latin-1")
    length = struct.pack("<H" if version == 1 else "<I", len(head))
    if data is None:
        count = 1
        for d in shape:
            count *= d
        data = bytes((i * 37) & 0xFF for i in range(count * SIZES.get(descr, 4)))
    return b"\x93NUMPY" + bytes([version, 0]) + length + head + data


def first_rows(path, rows):
    raw = path.read_bytes()
    length = struct.unpack("<H", raw[8:10])[0]
    header = ast.literal_eval(raw[10:10 + length].decode("latin-1"))
    shape = (min(header["shape"][0], rows),) + tuple(header["shape"][1:])
    per_row = SIZES[header["descr"]]
    for d in header["shape"][1:]:
        per_row *= d
    data = raw[10 + length:10 + length + shape[0] * per_row]
    return npy(header["descr"], shape, data)


def main():
    OUT.mkdir(parents=True, exist_ok=True)
    for old in OUT.glob("*.npy"):
        old.unlink()
    seeds = {}
    for path in sorted((ROOT / "data").glob("*.npy")):
        seeds["data_" + path.stem] = first_rows(path, 3)
    labels = struct.pack("<3q", 0, 2, 1)
    seeds.update({
        "features_n4": npy("<f4", (3, 4)),
        "features_n2x2": npy("<f4", (2, 2, 2)),
        "labels_i8": npy("<i8", (3,), labels),
        "labels_i4": npy("<i4", (3,), struct.pack("<3i", 0, 2, 1)),
        "labels_out_of_range": npy("<i8", (2,), struct.pack("<2q", -1, 7)),
        "targets_n3": npy("<f4", (3, 3)),
        "features_3d": npy("<f4", (2, 3, 4)),
        "scalar_f4": npy("<f4", ()),
        "empty_rows": npy("<f4", (0, 4)),
        "zero_width": npy("<f4", (5, 0)),
        "big_endian_f4": npy(">f4", (2, 2)),
        "bool": npy("|b1", (4,)),
        "float64": npy("<f8", (2,)),
        "fortran_order": npy("<f4", (2, 3), fortran=True),
        "version2": npy("<f4", (3, 4), version=2),
        "version3_i8": npy("<i8", (3,), labels, version=3),
        "double_quotes": npy("<f4", (1, 4), text='{"descr": "<f4", "fortran_order": False, "shape": (1, 4)}'),
        "no_trailing_commas": npy("<i8", (3,), labels,
                                  text="{'descr':'<i8','fortran_order':False,'shape':(3,)}"),
        "missing_shape": npy("<f4", (2,), text="{'descr': '<f4', 'fortran_order': False}"),
        "structured": npy("<f4", (2,), text="{'descr': [('a', '<f4')], 'fortran_order': False, 'shape': (2,), }"),
        "truncated_data": npy("<f4", (4, 4))[:-5],
    })
    for name, data in seeds.items():
        (OUT / (name + ".npy")).write_bytes(data)
    print("wrote %d seeds to %s" % (len(seeds), OUT.relative_to(ROOT)))


if __name__ == "__main__":
    main()
