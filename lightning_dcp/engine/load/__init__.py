"""Loading: restore, local and indexed loads, the verifying reader, shared reads, the page cache, entry-by-entry sources."""
