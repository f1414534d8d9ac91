"""Small widgets and behaviours the desktop shares (Qt only): the wheel guard, tabs whose row wraps,
the colour of error text."""
