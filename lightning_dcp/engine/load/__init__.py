"""Loading: restores, local and indexed loads, the verifying reader, shared reads, the page cache, sources."""
