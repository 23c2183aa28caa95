"""Saving: planning, global plans, the writer, data files, incremental and async saves, staging, the step gate."""
