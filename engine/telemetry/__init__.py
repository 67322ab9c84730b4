"""What the engine measures and reports: `metrics` (counters, histograms, events as they happen),
`stats` (the stats frame and the gauges a /metrics scrape reads), `trace` (every request and step,
for a snapshot and the what-if), `flight_recorder` (the last frames, for a snapshot)."""
