//! Commit-reveal v4 (drand-timelocked weights): the pure decision between a plain
//! `set_weights` and a timelocked commit, and the drand reveal round of a commit.
//!
//! Everything here is a function of a recorded [`CommitRevealState`] (read once per tick by
//! [`crate::chain::Chain::commit_reveal_state`]) and the wall clock, so it is unit-tested
//! from recorded chain states. Rules, from the subtensor source (spec 425) and
//! bittensor-drand:
//!
//! * `CommitRevealWeightsEnabled(netuid)` off → plain `set_weights` (unchanged path).
//! * On → `commit_timelocked_mechanism_weights(netuid, 0, commit, reveal_round, version)`
//!   or `commit_timelocked_weights(netuid, commit, reveal_round, version)`, whichever the
//!   runtime's metadata has; `version` must equal the chain's `CommitRevealWeightsVersion`
//!   (dispatch error `IncorrectCommitRevealVersion` otherwise); this client builds v4.
//! * The pool refuses `reveal_round < Drand.LastStoredRound` (`Custom(15)`,
//!   `InvalidRevealRound`, `guards/check_weights.rs`).
//! * Reveal epoch, stateful schedule (spec ≥ 423: `LastEpochBlock`, `PendingEpochAt`,
//!   `SubnetEpochIndex`, `BlocksSinceLastStep`): the commit is keyed by
//!   `current_epoch_with_lookahead` of its inclusion block (`SubnetEpochIndex`, plus one when
//!   an epoch fires in that block, `should_run_epoch`), and is revealed in the block where
//!   the epoch index reaches `commit_epoch + RevealPeriodEpochs` (`reveal_commits.rs`).
//!   Epochs fire at `LastEpochBlock + tempo`, earlier at `PendingEpochAt` when set.
//! * Reveal epoch, legacy modulo schedule (bittensor-drand 1.x, runtimes without
//!   `LastEpochBlock`): `epoch(b) = (b + netuid + 1) / (tempo + 1)`, first block of epoch `e`
//!   = `e·(tempo + 1) − (netuid + 1)`.
//! * Both: the target block is the reveal block plus [`SECURITY_BLOCK_OFFSET`] (time for the
//!   chain to ingest the pulse), converted to a drand quicknet round with the wall clock:
//!   `round = ⌊(now + blocks·block_time − genesis) / period⌋` (at least 1), as
//!   bittensor-drand does.

/// drand quicknet genesis time, unix seconds (subtensor `pallet_drand` `BeaconConfig`).
pub const DRAND_QUICKNET_GENESIS: u64 = 1_692_803_367;

/// drand quicknet period, seconds.
pub const DRAND_QUICKNET_PERIOD: u64 = 3;

/// Blocks after the reveal block that the target pulse is aimed at (bittensor-drand's
/// `SECURITY_BLOCK_OFFSET`).
pub const SECURITY_BLOCK_OFFSET: u64 = 3;

/// The commit-reveal version this client builds (`CommitRevealWeightsVersion`, default 4 in
/// subtensor): the hotkey-bound [`crate::timelock::WeightsTlockPayload`].
pub const COMMIT_REVEAL_VERSION: u16 = 4;

/// subtensor's `MAX_TEMPO`: an epoch is forced once `BlocksSinceLastStep` exceeds it.
pub const MAX_TEMPO: u64 = 50_400;

/// Block time assumed when the runtime names none (finney: 12 s).
pub const DEFAULT_BLOCK_TIME_MS: u64 = 12_000;

/// The timelocked commit call the runtime's metadata has.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CommitCall {
    /// `commit_timelocked_mechanism_weights(netuid, mecid, commit, reveal_round, version)`
    /// (bittensor SDK 10+); this client uses mechanism 0.
    TimelockedMechanismWeights,
    /// `commit_timelocked_weights(netuid, commit, reveal_round, version)` (SDK 9.x).
    TimelockedWeights,
}

impl CommitCall {
    /// The call name in pallet `SubtensorModule`.
    pub fn name(self) -> &'static str {
        match self {
            CommitCall::TimelockedMechanismWeights => "commit_timelocked_mechanism_weights",
            CommitCall::TimelockedWeights => "commit_timelocked_weights",
        }
    }

    /// The call to use when the runtime has the calls `has(name)` says, preferring the
    /// mechanism form. `None` = the runtime has neither.
    pub fn pick(has: impl Fn(&str) -> bool) -> Option<CommitCall> {
        [
            CommitCall::TimelockedMechanismWeights,
            CommitCall::TimelockedWeights,
        ]
        .into_iter()
        .find(|c| has(c.name()))
    }
}

/// The stateful epoch schedule of a subnet (spec ≥ 423), as stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct EpochSchedule {
    /// `LastEpochBlock(netuid)`: block the last epoch ran.
    pub last_epoch_block: u64,
    /// `PendingEpochAt(netuid)`: owner-triggered epoch block, 0 when none.
    pub pending_epoch_at: u64,
    /// `SubnetEpochIndex(netuid)`: monotonic epoch counter.
    pub subnet_epoch_index: u64,
    /// `BlocksSinceLastStep(netuid)`.
    pub blocks_since_last_step: u64,
}

/// The chain state that decides the submission path, read at one block.
#[derive(Debug, Clone, PartialEq)]
pub struct CommitRevealState {
    /// The netuid.
    pub netuid: u16,
    /// The block the state was read at (the commit lands in a later block).
    pub block: u64,
    /// `CommitRevealWeightsEnabled(netuid)`.
    pub enabled: bool,
    /// `CommitRevealWeightsVersion`, `None` when the runtime has no such item.
    pub version: Option<u16>,
    /// `Tempo(netuid)`, blocks.
    pub tempo: u16,
    /// `RevealPeriodEpochs(netuid)`.
    pub reveal_period_epochs: u64,
    /// `Drand.LastStoredRound`, `None` when the runtime has no pallet Drand.
    pub last_stored_round: Option<u64>,
    /// The stateful schedule, `None` on runtimes without `LastEpochBlock`.
    pub schedule: Option<EpochSchedule>,
    /// The timelocked commit call in the metadata, if any.
    pub commit_call: Option<CommitCall>,
    /// Block time, milliseconds.
    pub block_time_ms: u64,
}

/// Which reveal-epoch rule a plan used.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RevealRule {
    /// The stateful schedule (spec ≥ 423; bittensor-drand 2.0 `get_encrypted_commit_v2`).
    Stateful,
    /// The legacy modulo schedule (bittensor-drand 1.x `get_encrypted_commit`).
    Legacy,
}

/// Where and when a commit made now reveals.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RevealPlan {
    /// The rule used.
    pub rule: RevealRule,
    /// The epoch the commit is keyed by (stateful: `SubnetEpochIndex` value; legacy: the
    /// modulo epoch index).
    pub commit_epoch: u64,
    /// The epoch it reveals in.
    pub reveal_epoch: u64,
    /// The first block of the reveal epoch (the block the chain first tries the reveal).
    pub reveal_block: u64,
    /// Blocks from the state's block to the pulse target (`reveal_block + 3`).
    pub blocks_until_target: u64,
}

impl RevealPlan {
    /// The drand quicknet round for this plan at wall-clock `now_ms` (unix milliseconds)
    /// with `block_time_ms` per block: `⌊(now + blocks·block_time − genesis) / 3 s⌋`, at
    /// least 1.
    pub fn reveal_round(&self, now_ms: u64, block_time_ms: u64) -> u64 {
        let target_ms =
            u128::from(now_ms) + u128::from(self.blocks_until_target) * u128::from(block_time_ms);
        let genesis_ms = u128::from(DRAND_QUICKNET_GENESIS) * 1000;
        let period_ms = u128::from(DRAND_QUICKNET_PERIOD) * 1000;
        let round = target_ms.saturating_sub(genesis_ms) / period_ms;
        u64::try_from(round).unwrap_or(u64::MAX).max(1)
    }
}

/// The submission a tick makes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Submission {
    /// Plain `set_weights` (commit-reveal off).
    SetWeights,
    /// A timelocked commit.
    Commit {
        /// The call to use.
        call: CommitCall,
        /// `commit_reveal_version` sent.
        version: u16,
        /// The drand round the ciphertext is locked to.
        reveal_round: u64,
        /// The reveal epoch and block.
        plan: RevealPlan,
    },
}

impl Submission {
    /// `set_weights` or the commit call's name.
    pub fn path(&self) -> &'static str {
        match self {
            Submission::SetWeights => "set_weights",
            Submission::Commit { call, .. } => call.name(),
        }
    }
}

/// Why a commit could not be accepted (commit-reveal on, no valid commit possible).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CommitRevealError {
    /// Commit-reveal is on but the runtime has neither timelocked commit call.
    #[error("commit-reveal is enabled but the runtime has neither commit_timelocked_mechanism_weights nor commit_timelocked_weights (pre-CRv4 runtime); no weights can land until the subnet owner disables commit-reveal or the chain upgrades")]
    NoCommitCall,
    /// The chain expects another commit-reveal version.
    #[error("the chain expects commit-reveal version {chain} (CommitRevealWeightsVersion) but this validator builds version {ours}; a commit would fail with IncorrectCommitRevealVersion — upgrade engy-validator")]
    VersionMismatch {
        /// `CommitRevealWeightsVersion`.
        chain: u16,
        /// [`COMMIT_REVEAL_VERSION`].
        ours: u16,
    },
    /// The runtime has no pallet Drand, so no commit can ever be revealed.
    #[error("commit-reveal is enabled but the runtime has no Drand.LastStoredRound; a timelocked commit could never be revealed")]
    NoDrand,
    /// Tempo 0: the subnet runs no epochs, a commit never reveals.
    #[error(
        "tempo is 0 on netuid {0}: the subnet runs no epochs, a commit would never be revealed"
    )]
    TempoZero(u16),
    /// The computed reveal round is behind the chain's drand.
    #[error("reveal round {round} is behind Drand.LastStoredRound {last_stored}: the pool would refuse the commit (Custom(15) InvalidRevealRound); the host clock is behind — fix NTP (timedatectl set-ntp true)")]
    RevealRoundBehind {
        /// The round computed from the wall clock.
        round: u64,
        /// `Drand.LastStoredRound`.
        last_stored: u64,
    },
}

fn should_run_epoch(
    s: &EpochSchedule,
    tempo: u64,
    block: u64,
    blocks_since_last_step: u64,
) -> bool {
    if tempo == 0 {
        return false;
    }
    if s.pending_epoch_at > 0 && block >= s.pending_epoch_at {
        return true;
    }
    if blocks_since_last_step > MAX_TEMPO {
        return true;
    }
    block.saturating_sub(s.last_epoch_block) >= tempo
}

/// The reveal plan under the stateful schedule for a commit included in block
/// `state_block + 1`.
pub fn stateful_plan(
    s: &EpochSchedule,
    tempo: u16,
    reveal_period: u64,
    state_block: u64,
) -> Option<RevealPlan> {
    let tempo = u64::from(tempo);
    if tempo == 0 {
        return None;
    }
    let inclusion = state_block.saturating_add(1);
    let steps = inclusion.saturating_sub(state_block);
    let fires = should_run_epoch(
        s,
        tempo,
        inclusion,
        s.blocks_since_last_step.saturating_add(steps),
    );
    let (commit_epoch, mut next_fire) = if fires {
        (
            s.subnet_epoch_index.saturating_add(1),
            inclusion.saturating_add(tempo),
        )
    } else {
        let auto = s.last_epoch_block.saturating_add(tempo);
        let next = if s.pending_epoch_at > inclusion {
            auto.min(s.pending_epoch_at)
        } else {
            auto
        };
        (s.subnet_epoch_index, next.max(inclusion.saturating_add(1)))
    };
    let reveal_block = if reveal_period == 0 {
        inclusion
    } else {
        next_fire = next_fire.saturating_add(tempo.saturating_mul(reveal_period - 1));
        next_fire
    };
    Some(RevealPlan {
        rule: RevealRule::Stateful,
        commit_epoch,
        reveal_epoch: commit_epoch.saturating_add(reveal_period),
        reveal_block,
        blocks_until_target: reveal_block
            .saturating_add(SECURITY_BLOCK_OFFSET)
            .saturating_sub(state_block),
    })
}

/// The reveal plan under the legacy modulo schedule (bittensor-drand 1.x).
pub fn legacy_plan(netuid: u16, tempo: u16, reveal_period: u64, block: u64) -> RevealPlan {
    let tempo_plus_one = u64::from(tempo).saturating_add(1);
    let netuid_plus_one = u64::from(netuid) + 1;
    let commit_epoch = block.saturating_add(netuid_plus_one) / tempo_plus_one;
    let reveal_epoch = commit_epoch.saturating_add(reveal_period);
    let reveal_block = reveal_epoch
        .saturating_mul(tempo_plus_one)
        .saturating_sub(netuid_plus_one);
    RevealPlan {
        rule: RevealRule::Legacy,
        commit_epoch,
        reveal_epoch,
        reveal_block,
        blocks_until_target: reveal_block
            .saturating_add(SECURITY_BLOCK_OFFSET)
            .saturating_sub(block),
    }
}

/// Plain `set_weights` or a timelocked commit, from `state` and the wall clock `now_ms`
/// (unix milliseconds). Errors say why no commit could be accepted while commit-reveal is
/// on; with commit-reveal off the answer is always [`Submission::SetWeights`].
pub fn decide(state: &CommitRevealState, now_ms: u64) -> Result<Submission, CommitRevealError> {
    if !state.enabled {
        return Ok(Submission::SetWeights);
    }
    let call = state.commit_call.ok_or(CommitRevealError::NoCommitCall)?;
    let version = state.version.unwrap_or(COMMIT_REVEAL_VERSION);
    if version != COMMIT_REVEAL_VERSION {
        return Err(CommitRevealError::VersionMismatch {
            chain: version,
            ours: COMMIT_REVEAL_VERSION,
        });
    }
    let last_stored = state.last_stored_round.ok_or(CommitRevealError::NoDrand)?;
    let plan = match &state.schedule {
        Some(s) => stateful_plan(s, state.tempo, state.reveal_period_epochs, state.block)
            .ok_or(CommitRevealError::TempoZero(state.netuid))?,
        None if state.tempo == 0 => return Err(CommitRevealError::TempoZero(state.netuid)),
        None => legacy_plan(
            state.netuid,
            state.tempo,
            state.reveal_period_epochs,
            state.block,
        ),
    };
    let reveal_round = plan.reveal_round(now_ms, state.block_time_ms);
    if reveal_round < last_stored {
        return Err(CommitRevealError::RevealRoundBehind {
            round: reveal_round,
            last_stored,
        });
    }
    Ok(Submission::Commit {
        call,
        version,
        reveal_round,
        plan,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW_MS: u64 = 1_764_600_000_000; // 2025-12-01T14:40:00Z

    fn sched(last: u64, pending: u64, index: u64, since: u64) -> EpochSchedule {
        EpochSchedule {
            last_epoch_block: last,
            pending_epoch_at: pending,
            subnet_epoch_index: index,
            blocks_since_last_step: since,
        }
    }

    fn state(block: u64, schedule: Option<EpochSchedule>) -> CommitRevealState {
        CommitRevealState {
            netuid: 53,
            block,
            enabled: true,
            version: Some(4),
            tempo: 360,
            reveal_period_epochs: 1,
            last_stored_round: Some(1),
            schedule,
            commit_call: Some(CommitCall::TimelockedMechanismWeights),
            block_time_ms: 12_000,
        }
    }

    #[test]
    fn commit_reveal_off_is_plain_set_weights_whatever_else_the_chain_says() {
        let mut s = state(1010, None);
        s.enabled = false;
        s.commit_call = None;
        s.version = Some(3);
        s.last_stored_round = None;
        s.tempo = 0;
        assert_eq!(decide(&s, NOW_MS), Ok(Submission::SetWeights));
        assert_eq!(Submission::SetWeights.path(), "set_weights");
    }

    /// Table recorded from bittensor-drand 2.0.0 `get_encrypted_commit_v2` (its reveal
    /// round implies these block offsets: round·3 + genesis − now ≈ blocks·12 s).
    #[test]
    fn commit_reveal_stateful_schedule_table() {
        // (last, pending, index, since, block, period) → (commit epoch, reveal block, blocks)
        type Row = ((u64, u64, u64, u64, u64, u64), (u64, u64, u64));
        let table: &[Row] = &[
            ((1000, 0, 50, 10, 1010, 1), (50, 1360, 353)),
            ((1000, 0, 50, 10, 1100, 1), (50, 1360, 263)),
            // the inclusion block 1360 fires the epoch: keyed by the next epoch
            ((1000, 0, 50, 10, 1359, 1), (51, 1720, 364)),
            ((1000, 0, 50, 10, 1360, 1), (51, 1721, 364)),
            ((1000, 0, 50, 10, 1361, 1), (51, 1722, 364)),
            ((1000, 0, 50, 10, 1010, 2), (50, 1720, 713)),
            ((1000, 0, 50, 10, 1010, 0), (50, 1011, 4)),
            // an owner-triggered epoch comes first
            ((1000, 1200, 50, 10, 1010, 1), (50, 1200, 193)),
            ((1000, 1011, 50, 10, 1010, 1), (51, 1371, 364)),
            ((1000, 0, 0, 10, 1010, 1), (0, 1360, 353)),
        ];
        for &((last, pending, index, since, block, period), (epoch, reveal, blocks)) in table {
            let p = stateful_plan(&sched(last, pending, index, since), 360, period, block).unwrap();
            assert_eq!(
                (p.commit_epoch, p.reveal_block, p.blocks_until_target),
                (epoch, reveal, blocks),
                "last {last} pending {pending} index {index} block {block} period {period}"
            );
            assert_eq!(p.reveal_epoch, epoch + period);
            assert_eq!(p.rule, RevealRule::Stateful);
        }
        // BlocksSinceLastStep past MAX_TEMPO forces an epoch in the inclusion block
        let p = stateful_plan(&sched(1000, 0, 50, MAX_TEMPO), 360, 1, 1010).unwrap();
        assert_eq!((p.commit_epoch, p.reveal_block), (51, 1371));
        assert!(stateful_plan(&sched(1000, 0, 50, 10), 0, 1, 1010).is_none());
    }

    /// bittensor-drand 1.x `generate_commit`: epoch = (block + netuid + 1) / (tempo + 1).
    #[test]
    fn commit_reveal_legacy_modulo_schedule_table() {
        // netuid 53, tempo 360: epochs start at e·361 − 54
        let table: &[(u64, u64, (u64, u64, u64))] = &[
            (1010, 1, (2, 1029, 22)),
            (1028, 1, (2, 1029, 4)),
            (1029, 1, (3, 1390, 364)),
            (1010, 2, (2, 1390, 383)),
            (1010, 0, (2, 668, 0)),
        ];
        for &(block, period, (epoch, reveal, blocks)) in table {
            let p = legacy_plan(53, 360, period, block);
            assert_eq!(
                (p.commit_epoch, p.reveal_block, p.blocks_until_target),
                (epoch, reveal, blocks),
                "block {block} period {period}"
            );
        }
    }

    #[test]
    fn commit_reveal_round_is_floored_from_the_wall_clock() {
        let p = legacy_plan(53, 360, 1, 1010); // 22 blocks
        let now = (DRAND_QUICKNET_GENESIS + 3 * 1_000_000) * 1000;
        // 22 · 12 s = 264 s = 88 rounds exactly
        assert_eq!(p.reveal_round(now, 12_000), 1_000_088);
        assert_eq!(p.reveal_round(now + 2_999, 12_000), 1_000_088);
        assert_eq!(p.reveal_round(now + 3_000, 12_000), 1_000_089);
        // fast blocks (250 ms): 22 · 0.25 s = 5.5 s → 1 round
        assert_eq!(p.reveal_round(now, 250), 1_000_001);
        // a clock before drand genesis still gives round 1
        assert_eq!(p.reveal_round(0, 12_000), 1);
    }

    #[test]
    fn commit_reveal_decision_picks_the_rule_from_what_the_metadata_has() {
        let sched = sched(1000, 0, 50, 10);
        let Ok(Submission::Commit {
            call,
            version,
            reveal_round,
            plan,
        }) = decide(&state(1010, Some(sched)), NOW_MS)
        else {
            panic!("expected a commit");
        };
        assert_eq!(call, CommitCall::TimelockedMechanismWeights);
        assert_eq!(version, 4);
        assert_eq!(plan.rule, RevealRule::Stateful);
        assert_eq!(reveal_round, plan.reveal_round(NOW_MS, 12_000));
        let Ok(Submission::Commit { plan, .. }) = decide(&state(1010, None), NOW_MS) else {
            panic!("expected a commit");
        };
        assert_eq!(plan.rule, RevealRule::Legacy);
        // a runtime without CommitRevealWeightsVersion is taken as v4
        let mut s = state(1010, Some(sched));
        s.version = None;
        assert!(matches!(decide(&s, NOW_MS), Ok(Submission::Commit { .. })));
    }

    #[test]
    fn commit_reveal_refusals_name_the_cause() {
        let base = state(1010, Some(sched(1000, 0, 50, 10)));
        let mut s = base.clone();
        s.commit_call = None;
        assert_eq!(decide(&s, NOW_MS), Err(CommitRevealError::NoCommitCall));
        let mut s = base.clone();
        s.version = Some(3);
        let e = decide(&s, NOW_MS).unwrap_err();
        assert_eq!(e, CommitRevealError::VersionMismatch { chain: 3, ours: 4 });
        assert!(e.to_string().contains("IncorrectCommitRevealVersion"));
        let mut s = base.clone();
        s.last_stored_round = None;
        assert_eq!(decide(&s, NOW_MS), Err(CommitRevealError::NoDrand));
        let mut s = base.clone();
        s.tempo = 0;
        assert_eq!(decide(&s, NOW_MS), Err(CommitRevealError::TempoZero(53)));
        let mut s = base.clone();
        s.schedule = None;
        s.tempo = 0;
        assert_eq!(decide(&s, NOW_MS), Err(CommitRevealError::TempoZero(53)));
        // the chain's drand is ahead of the round this clock gives
        let round = stateful_plan(&sched(1000, 0, 50, 10), 360, 1, 1010)
            .unwrap()
            .reveal_round(NOW_MS, 12_000);
        let mut s = base.clone();
        s.last_stored_round = Some(round + 1);
        let e = decide(&s, NOW_MS).unwrap_err();
        assert_eq!(
            e,
            CommitRevealError::RevealRoundBehind {
                round,
                last_stored: round + 1
            }
        );
        assert!(e.to_string().contains("Custom(15)"));
        s.last_stored_round = Some(round);
        assert!(
            decide(&s, NOW_MS).is_ok(),
            "equal to LastStoredRound is accepted"
        );
    }

    #[test]
    fn commit_reveal_call_prefers_the_mechanism_form() {
        assert_eq!(
            CommitCall::pick(
                |n| n == "commit_timelocked_weights" || n == "commit_timelocked_mechanism_weights"
            ),
            Some(CommitCall::TimelockedMechanismWeights)
        );
        assert_eq!(
            CommitCall::pick(|n| n == "commit_timelocked_weights"),
            Some(CommitCall::TimelockedWeights)
        );
        assert_eq!(CommitCall::pick(|n| n == "commit_crv3_weights"), None);
    }
}
