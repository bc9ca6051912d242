-- engy audit service, schema 2: the near-tie ledger. Per verdict whose cell challenge was
-- answered with a bundle, the bundle's near-tie cells and its judged cells
-- (engy_model::cells::stats::CellStats near_ties / n); NULL where no bundle was judged. A
-- miner's running totals are these columns summed over its verdicts (docs/AUDIT-SERVICE.md).
ALTER TABLE verdicts ADD COLUMN near_ties BIGINT;
ALTER TABLE verdicts ADD COLUMN cells_judged BIGINT;
