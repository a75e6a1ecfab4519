"""The notebook's face: magics, the control panel, export to scripts, the demo and example cells.
Thin adapters over the plain Python API.
"""
