"""Model file to Profile: layer discovery, dataflow, timing and memory measured on the device."""
