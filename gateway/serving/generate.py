"""Chat and completions as the pipeline serves them (a `Call`, pipeline.py): the checked
`Request`, the model it names or `auto` picks (choice.py; its label goes out in
`x-duet-auto-label`), its size on that model (measure.py), and its tries along the model's
fallback chain (attempts.py). The translated APIs (gateway/api/anthropic, gateway/api/responses)
hand the pipeline the same typed `Request` their chat request checks into.
"""

from __future__ import annotations

import logging

from gateway.accounts.ledger import Ledger
from gateway.accounts.store.base import Team
from gateway.backends.base import ServedModel
from gateway.config import AUTO, ModelConfig, TeamPolicy, Tier
from gateway.config_adapters import may_use
from gateway.serving.attempts import Tries
from gateway.serving.chat import parse_chat
from gateway.serving.choice import Need
from gateway.serving.context import Serving
from gateway.serving.features import features, refuse_missing
from gateway.serving.measure import Measured, estimate_tokens, measure, prompt_ids, tool_plan
from gateway.serving.pipeline import Admitted
from gateway.serving.requests import Endpoint, Request, parse_completion
from gateway.serving.tiers import team_tier
from protocol.openai import APIError
from runtime.tracing import GEN_AI_OPERATION, GEN_AI_PROVIDER, Attrs

log = logging.getLogger("duet.gateway")


def parse(endpoint: Endpoint, raw: bytes) -> Generate:
    """A `/v1/chat/completions` or `/v1/completions` body, parsed and checked, as a call."""
    return Generate(parse_chat(raw) if endpoint == Endpoint.CHAT else parse_completion(raw))


def forbidden(team_id: str, name: str, policy: TeamPolicy) -> None:
    """403 for a model the team's policy forbids (every endpoint names models so)."""
    if name in policy.forbid:
        raise APIError(
            403,
            f"team {team_id!r} may not use model {name!r}",
            type_="permission_error",
            param="model",
            code="model_forbidden",
        )


class Generate:
    """A chat or completions request (`Request`) as the pipeline's `Call`."""

    def __init__(self, request: Request) -> None:
        self.request = request
        self.endpoint = request.endpoint
        self.model = request.model
        self.user = request.user
        self.n = request.n
        self.service_tier = request.service_tier

    def attributes(self) -> Attrs:
        op = "chat" if self.endpoint == Endpoint.CHAT else "text_completion"
        return {GEN_AI_OPERATION: op, GEN_AI_PROVIDER: "duet", "duet.stream": self.request.stream}

    async def admit(self, serving: Serving, team_id: str, streamable: bool) -> None:
        req = self.request
        # the grammar engine's check of its constraint: off the event loop, bounded in time (a
        # pathological schema must not stall every other request; text/guide_compile.py). Its
        # verdict is cached per team: a shared cache's instant answer would tell a team which
        # schemas another team sent.
        domain = serving.config.cache_domain(team_id)
        await serving.guides.check(req.guide, req.guide_param or "response_format", domain)
        if req.stream and not streamable:
            raise APIError(400, "stream is not supported here", param="stream")

    def choose(
        self, serving: Serving, team_id: str, policy: TeamPolicy, tier: Tier
    ) -> tuple[ServedModel, dict[str, str]]:
        headers: dict[str, str] = {}
        if self.model == AUTO and serving.choice.serves_auto:
            served = self._auto(serving, tier, policy, headers)
        else:
            served = self._named(serving, team_id, policy)
        served.generator()  # an embedding model answers no chat: 400
        refuse_missing(self.request, served.config)
        if self.request.return_token_ids and served.tokenizer is None:
            raise APIError(
                400,
                f"model {served.config.name!r} is served by an external provider, whose answers "
                "carry no token ids (return_token_ids and /inference/v1/generate serve the "
                "models this gateway runs itself)",
                param="model",
            )
        return served, headers

    async def own_prompt_ids(
        self, serving: Serving, team: Team, tier_header: str | None, answers: str
    ) -> tuple[ServedModel, list[int]]:
        """The chosen model and the prompt's token ids, for the endpoints that answer from its
        tokenizer alone (render, count_tokens; `answers` says what they do, for the refusal):
        only a model this gateway runs itself, under the team's concurrency gate."""
        policy = serving.config.team_policy(team.id)
        tier = team_tier(tier_header, self.service_tier, team, policy)
        served, _ = self.choose(serving, team.id, policy, tier)
        if served.tokenizer is None:
            raise APIError(
                400,
                f"model {served.config.name!r} is served by an external provider: this gateway "
                f"{answers} only for the models it serves itself (with their tokenizer)",
                param="model",
            )
        serving.admission.check_team(team, serving.config.quotas.default_max_concurrent)
        with serving.admission.teams.running(team.id):
            ids = await prompt_ids(served, self.request, tool_plan(served, self.request))
        return served, ids

    async def measure(self, serving: Serving, served: ServedModel, team_id: str) -> Measured:
        return await measure(
            served, self.request, serving.guides, serving.config.cache_domain(team_id)
        )

    def chain(self, serving: Serving, served: ServedModel) -> tuple[ModelConfig, ...]:
        return serving.choice.chain(served.config.name)

    def attempts(self, serving: Serving, ledger: Ledger, a: Admitted) -> Tries:
        return Tries(serving, self.request, ledger, a)

    def _named(self, serving: Serving, team_id: str, policy: TeamPolicy) -> ServedModel:
        found = serving.models.get(self.model)
        if found is None or not may_use(found.config, team_id):  # a kept model: as if absent
            names = sorted(n for n, m in serving.models.items() if may_use(m.config, team_id))
            names += [AUTO] if serving.config.auto is not None else []
            raise APIError(
                404,
                f"the model {self.model!r} does not exist (served: {', '.join(names)})",
                param="model",
                code="model_not_found",
            )
        forbidden(team_id, self.model, policy)
        return found

    def _auto(
        self, serving: Serving, tier: Tier, policy: TeamPolicy, headers: dict[str, str]
    ) -> ServedModel:
        """The model `auto` picks for this request (its label goes out in `x-duet-auto-label`)."""
        req = self.request
        if req.messages is not None:
            messages = req.messages
        elif isinstance(req.prompt, str):
            messages = [{"role": "user", "content": req.prompt}]
        else:
            raise APIError(
                400,
                "model 'auto' needs a text prompt (token ids belong to one model's tokenizer)",
                param="prompt",
            )
        need = Need(
            req.endpoint, req.n, tier, policy, estimate_tokens(req), req.max_tokens, features(req)
        )
        c = serving.choice.auto(messages, need)
        if c.model is None:
            why = "; ".join(f"{m}: {r}" for m, r in c.skipped)
            unavailable = any(r == "unavailable" for _, r in c.skipped)
            raise APIError(
                503 if unavailable else 400,
                f"model 'auto': no model can take this request ({why})",
                type_="service_unavailable" if unavailable else "invalid_request_error",
                param="model",
                code="no_model_available",
            )
        headers["x-duet-auto-label"] = c.label
        log.debug("auto: label=%s → %s (%s)", c.label, c.model, c.reason)
        return serving.models[c.model]
