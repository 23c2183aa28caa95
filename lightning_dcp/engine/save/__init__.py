"""Saving: planning, global plans, the writer, data files, incremental saves, async saves, staging, live writes, the step gate."""
