"""The doors to storage: locations, paths, object-store quirks, local files, outputs, remote reads, fsspec options."""
