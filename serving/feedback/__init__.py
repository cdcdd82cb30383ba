"""What a replica keeps of each finished request: its feedback row, the segment files it is written to,
and the shipper that moves closed segments to object storage.
"""
