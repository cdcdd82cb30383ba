"""The fault suite behind `leap bench faults`: hostile clients, crashes, load, and the pipeline's own faults."""
