"""`slotmap simulate`: a synthetic workload through scheduler -> pool -> tiny decoder, verified as it runs."""
