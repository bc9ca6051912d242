//! `engy-validator check`: the operator's one-time preflight. Every line is `ok` or `FAIL`
//! with the fix; the exit code is non-zero when any line FAILs.

use crate::chain::{self, Chain};
use crate::config::Settings;
use crate::schedule;

/// Writes `line` and a newline to standard output (`check`'s and `health`'s report). A write
/// that fails, above all a reader that closed the pipe (`engy-validator check | head -1`), is
/// ignored instead of panicking as `println!` does: the command runs on and its exit code
/// stays its verdict's (docs/VALIDATOR.md "Exit codes").
pub fn stdout_line(line: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

/// Collected check lines.
#[derive(Debug, Default)]
pub struct Report {
    /// `(passed, line)` in order.
    pub lines: Vec<(bool, String)>,
}

impl Report {
    fn ok(&mut self, line: impl Into<String>) {
        let line = line.into();
        stdout_line(&format!("ok    {line}"));
        self.lines.push((true, line));
    }
    fn fail(&mut self, line: impl Into<String>) {
        let line = line.into();
        stdout_line(&format!("FAIL  {line}"));
        self.lines.push((false, line));
    }
    fn check(&mut self, pass: bool, line: impl Into<String>) {
        if pass {
            self.ok(line)
        } else {
            self.fail(line)
        }
    }
    /// True when no line failed.
    pub fn passed(&self) -> bool {
        self.lines.iter().all(|(p, _)| *p)
    }
}

/// Runs every check against `settings` and prints the lines.
pub async fn run(s: &Settings) -> Report {
    let mut r = Report::default();
    r.ok(format!(
        "config: netuid {}, network {} ({}), api {}, master {}, poll {} s, resubmit every {} blocks, state {}",
        s.netuid,
        s.network,
        s.chain_url,
        s.api,
        s.master_hotkey,
        s.poll_s,
        s.resubmit_blocks,
        s.state_file.display()
    ));
    let mut state_unwritable = false;
    for (what, path) in [("state", &s.state_file), ("heartbeat", &s.heartbeat_file)] {
        match crate::state::probe_writable(path) {
            Ok(()) => r.ok(format!("{what} file {} writable", path.display())),
            Err(e) => {
                state_unwritable |= what == "state";
                r.fail(format!(
                "{what} file {} cannot be written ({e}); fix: the directory's ownership/permissions (ENGY_SN53_UID/GID with compose) or ENGY_SN53_{}_FILE",
                path.display(),
                what.to_ascii_uppercase()
            ))
            }
        }
    }
    // one FAIL per cause: a state path that cannot be written (a directory, say) was named
    if let Some(why) = crate::state::damage(&s.state_file).filter(|_| !state_unwritable) {
        r.fail(format!(
            "state file {} is {why}: it would read as empty (the first tick submits at once); fix: run check as the daemon's user if it is a permission error, else restore the file from a backup or delete it",
            s.state_file.display()
        ));
    }

    // wallet
    let hotkey = match crate::wallet::load_hotkey(s) {
        Ok(l) => {
            r.ok(format!(
                "wallet {}/{} loads: hotkey {} ({}, key from {}, as bittensor-wallet reads it)",
                s.wallet,
                s.wallet_hotkey,
                l.hotkey.ss58(),
                l.path.display(),
                l.source_field
            ));
            let notes = crate::wallet::notes(&l);
            notes.problems.into_iter().for_each(|p| r.fail(p));
            notes
                .notes
                .into_iter()
                .for_each(|n| r.ok(format!("(warning) {n}")));
            Some(l.hotkey)
        }
        Err(e) => {
            let fix = crate::wallet::access_fix(&e).unwrap_or_else(|| "set ENGY_SN53_WALLET / ENGY_SN53_WALLET_HOTKEY / ENGY_SN53_WALLET_PATH to a bittensor hotkey file (encrypted: ENGY_SN53_WALLET_PASSWORD or ENGY_SN53_WALLET_PASSWORD_FILE)".into());
            r.fail(format!(
                "wallet {}/{} under {}: {e}; fix: {fix}",
                s.wallet,
                s.wallet_hotkey,
                s.wallet_path.display()
            ));
            None
        }
    };

    // provider
    let payload = match crate::provider::client() {
        Ok(http) => match crate::provider::fetch_latest(&http, &s.api).await {
            Ok(body) => match engy_core::payload::verify(&body, &s.master_hotkey, s.netuid) {
                Ok(v) => {
                    r.ok(format!(
                        "provider {} reachable; epoch {} verifies against master {} ({} hotkeys, digest {})",
                        s.api,
                        v.epoch_index,
                        s.master_hotkey,
                        v.weights.len(),
                        v.digest.get(..12).unwrap_or(&v.digest)
                    ));
                    let last_applied = crate::state::read(&s.state_file).last_applied;
                    if let Some(line) =
                        crate::daemon::replay_diagnosis(v.epoch_index, last_applied, &s.state_file)
                    {
                        r.fail(line);
                    }
                    Some(v)
                }
                Err(e) => {
                    r.fail(format!(
                        "provider {} payload rejected: {} ({e}); fix: check ENGY_SN53_API / ENGY_SN53_MASTER_HOTKEY (a pair) and the netuid",
                        s.api,
                        e.reason_word()
                    ));
                    None
                }
            },
            Err(e) => {
                r.fail(format!(
                    "provider {} unreachable: {e}; fix: check network egress to the provider (the validator keeps resubmitting its cached vector meanwhile)",
                    s.api
                ));
                None
            }
        },
        Err(e) => {
            r.fail(format!("HTTP client: {e}"));
            None
        }
    };

    // chain
    let chain = match Chain::connect(&s.chain_url).await {
        Ok(c) => c,
        Err(e) => {
            r.fail(format!(
                "chain {}: {e}; fix: check ENGY_SN53_NETWORK and that the node is reachable",
                s.chain_url
            ));
            return r;
        }
    };
    let block = chain.block_number().await.ok();
    let (spec, txv) = chain.runtime_version();
    r.check(
        block.is_some_and(|b| b > 0),
        format!(
            "chain {} reachable: runtime spec {spec} tx {txv}, block #{}",
            s.chain_url,
            block.map_or("?".into(), |b| b.to_string())
        ),
    );
    let bad = chain::unsupported_extensions(&chain.metadata());
    r.check(
        bad.is_empty(),
        if bad.is_empty() {
            format!(
                "transaction extensions encodable: {}",
                chain::extension_names(&chain.metadata()).join(", ")
            )
        } else {
            format!(
                "transaction extension(s) this validator cannot encode: {}; fix: upgrade engy-validator",
                bad.join(", ")
            )
        },
    );
    match chain.subnet_exists(s.netuid).await {
        Ok(true) => r.ok(format!("netuid {} exists", s.netuid)),
        Ok(false) => {
            r.fail(format!(
                "netuid {} does not exist on this chain; fix: ENGY_SN53_NETUID / ENGY_SN53_NETWORK",
                s.netuid
            ));
            return r;
        }
        Err(e) => r.fail(format!("netuid {}: {e}", s.netuid)),
    }
    let hp = match chain.hyperparams(s.netuid).await {
        Ok(h) => Some(h),
        Err(e) => {
            r.fail(format!("hyperparameters of netuid {}: {e}", s.netuid));
            None
        }
    };
    if let Some(h) = &hp {
        match chain.commit_reveal_state(s.netuid).await {
            Ok(cr) => {
                let now_ms = crate::liveness::unix_now().saturating_mul(1000);
                match crate::commit_reveal::decide(&cr, now_ms) {
                    Ok(crate::commit_reveal::Submission::SetWeights) => r.ok(format!(
                        "commit-reveal disabled on netuid {}: a submission now takes plain set_weights",
                        s.netuid
                    )),
                    Ok(crate::commit_reveal::Submission::Commit {
                        call,
                        version,
                        reveal_round,
                        plan,
                    }) => r.ok(format!(
                        "commit-reveal ENABLED on netuid {} (v{version}): a submission now takes {} locked to drand round {reveal_round} (Drand.LastStoredRound {}), revealed in chain epoch {} from block #{} ({:?} schedule, reveal period {} epoch(s))",
                        s.netuid,
                        call.name(),
                        cr.last_stored_round.map_or("?".into(), |r| r.to_string()),
                        plan.reveal_epoch,
                        plan.reveal_block,
                        plan.rule,
                        cr.reveal_period_epochs
                    )),
                    Err(e) => r.fail(format!(
                        "commit-reveal ENABLED on netuid {} and a commit could not be accepted: {e}",
                        s.netuid
                    )),
                }
            }
            Err(e) => r.fail(format!("commit-reveal state of netuid {}: {e}", s.netuid)),
        }
        r.check(
            version_key_ok(h.weights_version_key),
            format!(
                "weights_version_key {} (this validator sends {}){}",
                h.weights_version_key,
                crate::daemon::VERSION_KEY,
                if h.weights_version_key > crate::daemon::VERSION_KEY {
                    "; set_weights fails with IncorrectWeightVersionKey"
                } else {
                    ""
                }
            ),
        );
        r.check(
            s.resubmit_blocks > h.weights_rate_limit,
            format!(
                "resubmit interval {} blocks vs weights_rate_limit {}{}",
                s.resubmit_blocks,
                h.weights_rate_limit,
                if s.resubmit_blocks > h.weights_rate_limit { "" } else { "; fix: raise ENGY_SN53_RESUBMIT_BLOCKS above the rate limit (SettingWeightsTooFast otherwise)" }
            ),
        );
    }

    let Some(hotkey) = hotkey else { return r };
    let neuron = match chain.neuron(s.netuid, hotkey.public_key()).await {
        Ok(Some(n)) => {
            r.ok(format!(
                "hotkey {} registered on netuid {} at uid {}",
                hotkey.ss58(),
                s.netuid,
                n.uid
            ));
            Some(n)
        }
        Ok(None) => {
            r.fail(format!(
                "hotkey {} is not registered on netuid {} (set_weights fails with HotKeyNotRegisteredInSubNet); fix: btcli subnets register --netuid {}",
                hotkey.ss58(),
                s.netuid,
                s.netuid
            ));
            None
        }
        Err(e) => {
            r.fail(format!("neuron of {}: {e}", hotkey.ss58()));
            None
        }
    };
    if let (Some(n), Some(h)) = (neuron, &hp) {
        r.check(
            n.validator_permit,
            if n.validator_permit {
                format!("uid {} holds a validator permit", n.uid)
            } else {
                format!("uid {} has NO validator permit (NeuronNoValidatorPermit); fix: stake more so it ranks among the subnet's max_allowed_validators", n.uid)
            },
        );
        match n.stake {
            Some(stake) => r.check(
                stake > 0 && stake >= h.weights_min_stake,
                format!(
                    "stake {:.4} (alpha) on netuid {}, chain minimum WeightsMinStake {:.4}{}",
                    stake as f64 / 1e9,
                    s.netuid,
                    h.weights_min_stake as f64 / 1e9,
                    if stake > 0 && stake >= h.weights_min_stake {
                        ""
                    } else {
                        "; fix: add stake to the hotkey"
                    }
                ),
            ),
            None => r.ok("stake: this runtime has no TotalHotkeyAlpha; not checked"),
        }
        if let Some(b) = block {
            let a = crate::chain_rules::Activity {
                since: b.saturating_sub(n.last_update),
                cutoff: u64::from(h.activity_cutoff),
            };
            let verdict = if !a.alarming() {
                String::new()
            } else if a.remaining() == 0 {
                "; NOTHING HAS LANDED for the whole activity_cutoff: the validator is out of consensus until its next accepted weights; fix: start the daemon, or read its log for why nothing lands".to_owned()
            } else {
                format!(
                    "; NOTHING HAS LANDED for more than half of activity_cutoff: the validator drops out of consensus in {} blocks (~{} s) unless weights land; fix: start the daemon, or read its log for why nothing lands",
                    a.remaining(),
                    a.remaining().saturating_mul(schedule::BLOCK_S)
                )
            };
            r.check(
                !a.alarming(),
                format!(
                    "{} blocks since last_update (block #{}) vs activity_cutoff {}{verdict}",
                    a.since, n.last_update, h.activity_cutoff
                ),
            );
        }
    }
    let own_uid = neuron.map(|n| n.uid);

    // would the current payload land?
    if let (Some(v), Some(h)) = (payload, hp) {
        match chain.metagraph(s.netuid).await {
            Ok(mg) => {
                let res = schedule::resolve(&v.weights, &mg);
                let n = res.uids.len();
                let max = res.weights.iter().copied().max().unwrap_or(0);
                // the same rules `run` applies before submitting
                let refusal = crate::chain_rules::refusal(
                    &res,
                    own_uid,
                    mg.len(),
                    h.min_allowed_weights,
                    h.max_weight_limit,
                );
                let lands = !res.is_empty() && refusal.is_none();
                r.check(
                    lands,
                    format!(
                        "epoch {} would land: {n} of {} hotkeys resolve to uids (dropped {} holding {:.1}%), min_allowed_weights {}, largest weight {max} vs max_weight_limit {}{}",
                        v.epoch_index,
                        v.weights.len(),
                        res.dropped.len(),
                        res.dropped_share * 100.0,
                        h.min_allowed_weights,
                        h.max_weight_limit,
                        refusal.map(|r| format!("; {r}")).unwrap_or_default()
                    ),
                );
            }
            Err(e) => r.fail(format!("metagraph of netuid {}: {e}", s.netuid)),
        }
    }
    r
}

/// The runtime accepts `version_key >= weights_version_key` (PROTOCOL.md §7 step 8 sends 0).
fn version_key_ok(subnet_key: u64) -> bool {
    subnet_key
        .checked_sub(crate::daemon::VERSION_KEY)
        .is_none_or(|d| d == 0)
}
