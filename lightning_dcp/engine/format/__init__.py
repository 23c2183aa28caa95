"""Bytes and names on disk, no I/O: marker, record index, records, metadata checks, codec, blobs, keys, layout."""
