"""The readout a replica predicts with: what serves (sources, the saved push), how a push is checked,
the predictor thread, online RLS correction, and a challenger held in shadow.
"""
