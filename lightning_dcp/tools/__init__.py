"""Tools on the engine: consolidation into one file, inspection, weights-only loads, streaming file writers.

They read any checkpoint the engine can read (lightning_dcp's, Lightning's sharded layout, plain DCP directories)
and import no front end.
"""
