-- Shared by every djlocks script; the script's own body follows.
-- KEYS[1] is the name's meta hash "<prefix>:{<name>}:m" (fields limit, fence,
-- name, ticket); every other key of the name shares its hash tag, so a
-- script touches one Redis Cluster slot. A slot's lease "s:<i>" is a string
-- with a TTL: "<token>\n<fence>\n<since ms>\n<identity JSON>[\n<run id>]";
-- a waiter's record "w:<secret>" (a waiter's id is its grant's secret) is
-- "<channel>\n<since ms>\n<ttl ms>\n<identity JSON>" while it waits and
-- "granted\n<slot>\n<fence>\n<expires ms>" once a release handed it a slot;
-- a waiter with no channel waits on its line "h:<secret>", a list the release
-- pushes that grant to (BLPOP wakes it).
-- "a:<secret>" exists while an operator asks the holder of that grant to give it
-- back (a graceful release); it expires when the operator's wait ends.
local meta = KEYS[1]
local base = string.sub(meta, 1, -2)
local queue = base .. 'q'

local function slot_key(i) return base .. 's:' .. i end
local function cool_key(i) return base .. 'c:' .. i end
local function waiter_key(id) return base .. 'w:' .. id end
local function asked_key(id) return base .. 'a:' .. id end
local function line_key(id) return base .. 'h:' .. id end

-- Redis's own clock: milliseconds and microseconds since the epoch.
local function clock()
  local t = redis.call('TIME')
  local seconds, micros = tonumber(t[1]), tonumber(t[2])
  return seconds * 1000 + math.floor(micros / 1000), seconds * 1000000 + micros
end

local function limit_of() return tonumber(redis.call('HGET', meta, 'limit') or '0') end

-- The lease's value if token holds it, else nil.
local function held_by(key, token)
  local value = redis.call('GET', key)
  if value and string.sub(value, 1, #token + 1) == token .. '\n' then return value end
  return nil
end

-- Walk the queue in ticket order, dropping waiters whose record expired (a
-- dead process). Calls visit(id) for each live waiter until it returns true
-- or cap live waiters were passed; returns how many it passed.
local function walk_queue(visit, cap)
  local start, passed, dead, stopped = 0, 0, {}, false
  while not stopped and passed < cap do
    local ids = redis.call('ZRANGE', queue, start, start + 15)
    if #ids == 0 then break end
    for _, id in ipairs(ids) do
      if redis.call('EXISTS', waiter_key(id)) == 0 then
        dead[#dead + 1] = id
      elseif visit(id) then
        stopped = true
      else
        passed = passed + 1
      end
      if stopped or passed >= cap then break end
    end
    start = start + #ids
  end
  if #dead > 0 then redis.call('ZREM', queue, unpack(dead)) end
  return passed
end

-- Write slot's lease for secret with the next fence: never below the last
-- one, and never below Redis's clock in microseconds, so a Redis that
-- restarts empty still issues higher fences. Returns the fence and the expiry.
local function grant(slot, secret, ttl_ms, identity)
  local now_ms, now_us = clock()
  local fence = string.format('%.0f',
    math.max(tonumber(redis.call('HGET', meta, 'fence') or '0') + 1, now_us))
  redis.call('HSET', meta, 'fence', fence)
  redis.call('SET', slot_key(slot), secret .. '\n' .. fence .. '\n' .. now_ms .. '\n' .. identity,
    'PX', ttl_ms)
  return fence, now_ms + tonumber(ttl_ms)
end

-- Hand each free slot (neither held nor cooling) to the next live waiter: the
-- slot is granted here, the waiter's record says so, and a push to its line
-- (or a message on its process's channel) brings it the grant with no further
-- round trip. If that is lost, the waiter finds the record at its next poll.
local function hand_off()
  if redis.call('ZCARD', queue) == 0 then return end
  for i = 0, limit_of() - 1 do
    if redis.call('EXISTS', slot_key(i), cool_key(i)) == 0 then
      local id, record
      walk_queue(function(candidate)
        id, record = candidate, redis.call('GET', waiter_key(candidate))
        return true
      end, 1)
      if not record then return end
      local channel, ttl, identity = string.match(record, '^([^\n]*)\n[^\n]*\n([^\n]*)\n(.*)$')
      local fence, expires = grant(i, id, ttl, identity)
      local handed = 'granted\n' .. i .. '\n' .. fence .. '\n' .. expires
      redis.call('ZREM', queue, id)
      redis.call('SET', waiter_key(id), handed, 'KEEPTTL')
      if channel == '' then
        redis.call('RPUSH', line_key(id), handed)
        redis.call('PEXPIRE', line_key(id), ttl)
      else
        redis.call('PUBLISH', channel, id .. '\n' .. handed)
      end
    end
  end
end
